"""The abort releases a gloo collective that is sending at the moment of the abort.

gloo queues a send whose write fails with ``EPIPE`` and, when the pair fails a moment later,
never wakes the thread waiting for that send: the wait lasts the group's timeout (30 minutes by
default). The abort used to shut the group's sockets down for writing at once, so a send that
gloo wrote in between hit ``EPIPE`` (on the code before the fix, one of the first three trials
below stayed blocked). Two real ranks, a real gloo group per trial: rank 0 sends in a loop,
rank 1 receives, and rank 0 aborts at a random moment.
"""

from __future__ import annotations

import os
import random
import threading
import time
from datetime import timedelta
from typing import Any

from tests._dist import run_ranks

TRIALS = 30
RELEASE_S = 5.0  # the loop must end this soon after the abort (it takes milliseconds)


def _send_or_receive(rank: int, tensor: Any, ended: threading.Event) -> None:
    import torch.distributed as dist

    try:
        while True:
            if rank == 0:
                dist.send(tensor, 1)
            else:
                dist.recv(tensor, 0)
    except Exception:  # the abort (rank 0) or the closed peer (rank 1) ended the loop
        pass
    finally:
        ended.set()


def aborted_sender_job() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from trainguard.restart.abort import GroupSockets, abort_distributed, destroy_groups

    rank = int(os.environ["RANK"])
    # both store connections exist before any group is built: made during a group's
    # constructor, the host's side of rank 1's connection would count as one of the group's
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), 2, rank == 0)
    store.set(f"hello{rank}", "1")
    store.wait([f"hello{1 - rank}"], timedelta(seconds=30))
    GroupSockets.install()
    blocked: list[int] = []
    trials = 0
    try:
        for trial in range(TRIALS):
            prefix = dist.PrefixStore(f"trial{trial}", store)
            dist.init_process_group("gloo", store=prefix, rank=rank, world_size=2)
            tensor = torch.ones(8)
            dist.all_reduce(tensor)  # both ranks are connected before the loop starts
            ended = threading.Event()
            loop = threading.Thread(
                target=_send_or_receive, args=(rank, tensor, ended), daemon=True
            )
            loop.start()
            if rank == 0:
                time.sleep(random.Random(trial).uniform(0.0, 0.005))
                abort_distributed()
            trials += 1
            if not ended.wait(RELEASE_S):
                blocked.append(trial)  # a blocked gloo thread: no further trial can run
                store.set(f"stop{rank}", "1")
                break
            destroy_groups()
            store.set(f"done{trial}/{rank}", "1")
            peer = f"done{trial}/{1 - rank}"
            while not store.check([peer]):
                if store.check([f"stop{1 - rank}"]):
                    return {"blocked": blocked, "trials": trials, "peer_stopped": True}
                time.sleep(0.01)
        if rank == 1:
            store.set("bye", "1")
        elif not blocked:  # the store's host stays up until the other rank is done with it
            store.wait(["bye"], timedelta(seconds=30))
    finally:
        GroupSockets.uninstall()
    return {"blocked": blocked, "trials": trials, "peer_stopped": False}


def test_an_abort_during_sends_releases_the_sender_every_time() -> None:
    results = run_ranks(aborted_sender_job, 2, timeout=150)
    sender = results[0].get()
    assert sender["blocked"] == [], f"rank 0's send stayed blocked after the abort: {sender}"
    receiver = results[1].get()
    assert receiver["blocked"] == [], f"rank 1's receive stayed blocked: {receiver}"
    assert sender["trials"] == receiver["trials"] == TRIALS
