"""Live-state recovery: after a fault, resume from the survivors' memory, not a checkpoint.

Replicated state (DDP; the replica groups of HSDP) survives a fault in the memory of the ranks
that did not fail. Register it once in a :class:`LiveState` (outside the restart wrapper, so it
lives across rounds), mark each optimizer update with ``live.update(step)``, and call
``live.recover()`` at the start of every round of the wrapped function::

    live = LiveState(model=net, optimizer=opt)

    @trainguard.restart.Wrapper(...)
    def train(call):
        dist.init_process_group("gloo")
        got = live.recover()
        first = got.step if got.live else load_my_checkpoint()   # then live.restored(first)
        for step in range(first, steps):
            loss = forward_backward(step)
            with live.update(step, call):   # a restart waits for the update
                opt.step()

Sharded state (DTensor leaves: FSDP2, HSDP, tensor parallelism) works the same way: a DTensor
travels as its local tensor, and the ranks that hold the same local shards form a replica group
by themselves (:mod:`._sharded`). Its model is sharded again every round, so the round's
objects go to ``live.recover(model=net, optimizer=opt)`` (names registered with
``LiveState(model=None, optimizer=None)``).

Protocol (:meth:`LiveState.recover`, a collective): every rank of the new round calls it once,
in the same order, after ``init_process_group`` and before any other collective on that group.

1. The ranks all-gather (step, torn, replica group key): the step a rank's state is at (the
   number of completed updates; none for a spare or a new process) and whether an update was
   interrupted (torn). A rank is torn from the moment anything writes into its state (a
   transfer received in place, a fallback's checkpoint load) until a verified load or
   ``live.restored(step)``: a record never outlives the state it describes.
2. Every rank computes the same plan: per replica group, the newest step that an untorn member
   holds; all groups must agree on it. Ranks at it keep their state untouched (no copy, no
   file). The others (torn, behind, spares, respawned processes) are receivers; each receives
   from a donor of its group, receivers spread over the donors so that transfers run in
   parallel.
3. A transfer carries an xxh3-64 checksum per tensor, computed by the donor when it sends; the
   receiver checks everything before it loads anything. A mismatch moves that receiver to the
   next donor of its group in another pass; with none left, every rank falls back.
4. **Fallback**: where some replica group has no untorn member (FSDP without replicas, a whole
   group lost, nobody trained yet), or the groups' newest steps differ, or every donor's
   transfer failed, ``recover()`` returns ``fallback`` (the reason) on every rank: load the
   checkpoint as without live state, then call ``live.restored(step)``. It is logged (a
   warning) and emitted as an event. With peer snapshots (``LiveState(snapshot_every=k)``,
   :mod:`._snapshot`) a round that the replicas cannot repair first looks for the newest step
   at which every rank's shards are held (live, in a rank's own snapshot, or in the copy its
   buddy holds): the lost shards come from there, every other rank loads its own snapshot
   of that step (``Recovery.snapshot``; at most ``k`` steps recomputed); only when the
   snapshots do not line up does it fall back, saying so.

Events: ``live_recover`` (every rank, every round: ``outcome`` live/fallback, ``step``,
``newest``, ``recomputed``, ``receivers``, ``nbytes``, ``reason``) and ``live_restored``
(after a fallback: the checkpoint's ``step`` and the steps ``recomputed``).
"""

from __future__ import annotations

from trainguard.live._outcome import Recovery
from trainguard.live.state import LiveState

__all__ = ["LiveState", "Recovery"]
