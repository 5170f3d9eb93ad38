"""Workers see the environment torchrun gives them, plus trainguard's variables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch._agents import Agents, leftovers

pytestmark = pytest.mark.timeout(60)

#: what trainguard launch adds to every worker's environment.
ADDED = {
    "TRAINGUARD_STORE_ADDR",
    "TRAINGUARD_GENERATION",
    "TRAINGUARD_INCARNATION",
    "TRAINGUARD_AGENT",
    # the preemption grace budget (--tg-preemption-grace), so that workers save within it
    "TRAINGUARD_PREEMPTION_GRACE",
    # its default: each attempt's bootstrap store lives in worker rank 0 (torch's shared agent
    # store leaks one attempt's keys into the next), unless the user set it
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
}
#: values that differ from run to run (ids, ports, paths named after the run id).
RUN_DEPENDENT = {"TG_TEST_RUN", "TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}
#: follows from TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE"}


def _envs(tmp: Path, module: str, env: dict[str, str] | None = None) -> dict[int, dict[str, str]]:
    out = tmp / module
    out.mkdir()
    with Agents(tmp, nodes=1, nproc=2, worker=["env", str(out)], module=module, env=env) as job:
        assert job.wait() == [0], job.output()
        assert leftovers(job.run_id) == []
    return {r: json.loads((out / f"env-{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.parametrize("share", [None, "1"])
def test_workers_see_torchruns_environment(tmp_path: Path, share: str | None) -> None:
    env = {} if share is None else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": share}
    theirs = _envs(tmp_path, "torch.distributed.run", env)
    ours = _envs(tmp_path, "trainguard.launch", env)
    added = ADDED - set(env)
    for rank in (0, 1):
        assert set(ours[rank]) - set(theirs[rank]) == added
        assert set(theirs[rank]) - set(ours[rank]) == set()
        differ = {k for k in theirs[rank] if theirs[rank][k] != ours[rank][k]}
        allowed = RUN_DEPENDENT | (AGENT_STORE if share is None else set())
        assert differ <= allowed, {k: (theirs[rank][k], ours[rank][k]) for k in differ - allowed}
        assert ours[rank]["RANK"] == str(rank) and ours[rank]["WORLD_SIZE"] == "2"
        assert ours[rank]["TRAINGUARD_GENERATION"] == "0"
        assert ours[rank]["TRAINGUARD_INCARNATION"] == "0"
        assert ours[rank]["TORCHELASTIC_USE_AGENT_STORE"] == "False"
        assert ours[rank]["TRAINGUARD_STORE_ADDR"].startswith("127.0.0.1:")
        assert ours[rank]["TRAINGUARD_AGENT"].startswith("trainguard-agent-")
