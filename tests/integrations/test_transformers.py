"""The Hugging Face Trainer with trainguard, real transformers and real gloo ranks (tests/_dist.py).

``trainer.train`` under the in-process restart Wrapper (new ``TrainingArguments`` and ``Trainer``
every round, ``new_round()`` first) survives an exception raised in a step and a SIGKILLed rank
replaced by a spare, resuming from TrainguardCallback's local replicated checkpoints, and ends
with the weights of the fault-free run of the same function under the same Wrapper (the
reference: the same code and settings, only without faults; two active ranks make DDP's
rebuilt bucket order irrelevant, see tests/integrations/test_lightning.py). A GPT-2 from a tiny
config, no download. A save returns while the writer is stopped: the step does not wait for it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import free_port, run_ranks
from tests.integrations import _transformers_job as job
from tests.integrations._checks import check_fault_run

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # accelerate's and transformers' hints
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("live", [True, False], ids=["live", "local_only"])
def test_train_under_the_wrapper_survives_an_exception_and_a_sigkill(
    tmp_path: Path, live: bool
) -> None:
    """By default the rounds resume from live state where the fault struck (steps 6 and 10:
    nothing recomputed; the spare receives rank 1's state from rank 0); with ``live=False``
    from the local checkpoints of steps 4 and 8. Both end bit-identical to the reference."""
    results = run_ranks(
        job.transformers_job,
        3,
        args=(str(tmp_path), (free_port(), free_port())),
        timeout=280,
        env={"TG_TEST_LIVE": "1" if live else "0"},
    )
    first = check_fault_run(results, tmp_path, job.STEPS, resumed=(6, 10) if live else (4, 8))
    sources = [r["source"] for r in first["faulty"]["rounds"]]
    assert sources == ([None, "live", "live"] if live else [None, "local", "local"]), sources
    spare = results[2].get()["faulty"]["rounds"]
    assert [r["source"] for r in spare] == ["live" if live else "local"], spare


@pytest.mark.timeout(120)
def test_a_save_returns_after_the_staging_copy_while_the_writer_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Trainer, TrainerCallback

    from trainguard.checkpoint import LocalCheckpointManager
    from trainguard.integrations.transformers import TrainguardCallback

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    callback = TrainguardCallback(tmp_path / "local", every_n_steps=2)
    seen: dict[str, Any] = {}
    files = lambda: sorted(str(p) for p in (tmp_path / "local").rglob("*") if p.is_file())  # noqa: E731

    class Stop(TrainerCallback):  # runs before `callback` saves step 2
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                callback._open()
                assert callback.manager is not None
                seen["pid"] = callback.manager._writer.pid
                os.kill(seen["pid"], signal.SIGSTOP)
                seen["files"] = files()
                seen["weights"] = {k: v.clone() for k, v in kw["model"].state_dict().items()}
            if state.global_step == 3:  # a whole step ran while nothing could be written
                seen["new"] = sorted(set(files()) - set(seen["files"]))
                os.kill(seen["pid"], signal.SIGCONT)

    model = job.tiny_gpt2()
    args = job.arguments(tmp_path, max_steps=4, ddp_backend=None)
    trainer = Trainer(
        model=model, args=args, train_dataset=job.dataset(), callbacks=[Stop(), callback]
    )
    trainer.train()
    assert "new" in seen and not seen["new"], "files were written while the writer was stopped"
    with LocalCheckpointManager(tmp_path / "local") as mgr:
        assert mgr.find_latest() == 4
        part = mgr.load(2)
    for key, value in seen["weights"].items():
        assert torch.equal(part["model"][key], value), key  # the values of the save's moment
