"""Train a small model, checkpoint it asynchronously every few steps, resume from the newest.

Run: ``.venv/bin/python examples/async_checkpoint.py [--root DIR]``. The training loop only
pays for copying the state into shared memory (here it overlaps the next step entirely); a
background writer process makes each checkpoint durable and verifiable.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from trainguard.checkpoint import AsyncCheckpointer, latest, load


def train(root: str, steps: int, start_from: dict | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = 0
    if start_from is not None:
        model.load_state_dict(start_from["model"])
        optimizer.load_state_dict(start_from["optim"])
        torch.set_rng_state(start_from["rng"])
        first = start_from["step"] + 1
        print(f"resumed at step {first}")
    with AsyncCheckpointer() as ckpt:
        ckpt.protect(optimizer)  # optimizer.step() waits for an overlapped copy to finish
        for step in range(first, steps):
            x = torch.randn(16, 32)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 5 == 4:
                state = {
                    "model": model.state_dict(),
                    "optim": optimizer.state_dict(),
                    "step": step,
                    "rng": torch.get_rng_state(),
                }
                ckpt.save(
                    state,
                    f"{root}/step{step:04d}",
                    overlap=True,
                    on_commit=lambda info: print(
                        f"  {info.path}: {info.file_bytes} bytes durable after "
                        f"{info.durable_seconds * 1e3:.1f} ms"
                    ),
                )
            ckpt.poll()  # runs callbacks, raises errors of failed saves; never blocks
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.root or tmp
        straight = train(f"{root}/straight", steps=20)
        train(f"{root}/resumed", steps=12)  # "crashes" after step 11
        newest = latest(f"{root}/resumed")
        print(f"newest checkpoint: {newest}")
        resumed = train(f"{root}/resumed", steps=20, start_from=load(newest))
        same = all(torch.equal(straight[k], resumed[k]) for k in straight)
        print("resumed run matches the uninterrupted one:", same)
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
