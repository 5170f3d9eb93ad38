"""Worker of the launcher tests of the integrations (``test_transformers_launch``,
``test_lightning_launch``).

Run as ``python -m trainguard.launch --standalone --nproc-per-node=3 <this file> OUT FAULTS JOB``:
each worker runs the job of ``_transformers_job`` or ``_lightning_job`` (JOB: "transformers",
"lightning") under the in-process restart Wrapper
(2 active ranks, 1 spare), with the faults when FAULTS is 1 (process 0 raises at step 6 of
round 0, process 1 SIGKILLs itself at step 10 of round 1; the launcher respawns it), and writes
``OUT/result-<RANK>-<pid>.json``: its rounds and final weights (None for a spare).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main() -> int:
    out, faults, name = Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
    import importlib

    import torch

    import trainguard.restart as tr
    from tests.integrations._checks import TIMEOUTS
    from trainguard.integrations._round import release_round

    _Job = importlib.import_module(f"tests.integrations._{name}_job")._Job

    torch.set_num_threads(1)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TG_PROCESS"] = os.environ["RANK"]
    job = _Job(out, faults)
    options = {**TIMEOUTS, "finalize": release_round}
    options.update(rank_filter=tr.MaxActiveWorldSize(2), rank_assignment=tr.FillGaps())
    final = tr.Wrapper(**options)(job)()
    release_round(strict=True)
    record = {
        "process": int(os.environ["RANK"]),
        "incarnation": os.environ.get("TRAINGUARD_INCARNATION"),
        "rounds": job.rounds,
        "final": {k: v.tolist() for k, v in final.items()} if final else None,
    }
    (out / f"result-{os.environ['RANK']}-{os.getpid()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
