# trainguard developer commands. Every target works on a fresh machine: it builds .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The CPU build of torch on this machine's disk; installed before the package so that pip never
# resolves the package's `torch>=2.6` range to a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
# every test but the soak on three pytest-xdist workers (tests/conftest.py keeps the
# emulated-host tests on one of them), then the soak alone: its leak counts are only clean
# without another test beside it. Most tests wait on processes, sockets and timeouts: on two
# workers the suite used 0.86 of this machine's 2 cores and took 19.9 min; on three, 16.5 min
# (then the soak, 45 s).
PYTEST_ARGS ?= -n 3 --dist loadgroup

.PHONY: test lint format bench demo clean soak-test compat gpu-check

# the tests' and tools' environment: the package with every dev tool and framework (pytest, ruff,
# mypy, Lightning, transformers; about 3-4 min the first time). It also satisfies the demo's.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(VENV)/.demo-installed $@

# the demo's environment: torch (CPU), xxhash, matplotlib for the timeline and the package itself,
# nothing else (`make test` adds the dev tools to the same .venv later). Byte-compiled after the
# installs on every core (pip compiles on one); never compiled, each demo process would compile
# torch on every run where PYTHONDONTWRITEBYTECODE is set (as here).
$(VENV)/.demo-installed: pyproject.toml
	@echo "make demo: setting up $(VENV) with what the demo needs: $(TORCH_PIN) (CPU build), trainguard (editable) with xxhash and matplotlib"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "make demo: installing $(TORCH_PIN)..."
	$(PY) -m pip install -q --progress-bar off --no-compile $(TORCH_PIN)
	@echo "make demo: installing trainguard with its [demo] extra (xxhash, matplotlib)..."
	$(PY) -m pip install -q --progress-bar off --no-compile -e '.[demo]'
	@echo "make demo: byte-compiling them on every core..."
	$(PY) -m compileall -q -j 0 src "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	@echo "make demo: installed; starting the demo"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS) -m "not soak"
	$(PY) -m pytest -m soak tests/test_soak.py

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples
	$(VENV)/bin/mypy

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix src tests bench examples
	$(VENV)/bin/ruff format src tests bench examples

# the demo: 4 ranks + 1 spare train through injected faults; DEMO_ARGS="--help" lists the flags.
# It needs only its own install (about a minute from nothing), not the dev tools.
DEMO_ARGS ?=
demo: $(VENV)/.demo-installed
	$(VENV)/bin/trainguard demo $(DEMO_ARGS)

bench: $(VENV)/.installed
	$(PY) bench/run_all.py

# the torch compatibility matrix (bench/compat.py: versions listed there; one cached venv per
# version under COMPAT_VENVS, ~5 GB and a few minutes each the first time)
COMPAT_VENVS ?= $(HOME)/.cache/trainguard/compat-venvs
COMPAT_ARGS ?=
compat: $(VENV)/.installed
	$(PY) bench/compat.py --venvs $(COMPAT_VENVS) $(COMPAT_ARGS)

# every CUDA/NCCL path on this machine's GPUs (bench/gpu_check.py); skips without CUDA
gpu-check: $(VENV)/.installed
	$(PY) bench/gpu_check.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache src/*.egg-info

# the short soak alone (10 faults, ~2 min; root for its tmpfs); `make test` runs it too
soak-test: $(VENV)/.installed
	$(PY) -m pytest -m soak tests/test_soak.py
