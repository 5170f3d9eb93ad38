"""Recovery: what :meth:`trainguard.live.LiveState.recover` did, for the caller and the log."""

from __future__ import annotations

import dataclasses

__all__ = ["Recovery"]


@dataclasses.dataclass(frozen=True)
class Recovery:
    """The outcome of one round's live-state recovery (the same on every rank, except the
    fields about this rank: ``received_from``, ``nbytes``).

    Attributes:
        step: the step every rank's state is at now (the next step to run); None on fallback.
        fallback: None when the state was recovered from live replicas; otherwise why not,
            and the caller loads a checkpoint (then calls ``live.restored(step)``).
        newest: the newest step any rank's state was at before the recovery.
        recomputed: steps that will run again (0 from live state; on fallback known only once
            the checkpoint's step is, see the ``live_restored`` event).
        receivers: the ranks whose state was replaced by a donor's.
        received_from: the donor this rank's state came from (None: it kept its own).
        nbytes: bytes this rank received.
        attempts: transfer passes (more than 1 when a transfer failed its checksum).
        problems: why transfers were refused (checksum mismatches), in order.
        seconds: how long the recovery took on this rank (from its call: waiting for the
            other ranks to call it too is counted).
        transfer_seconds: the transfer passes on this rank (0 when nobody received).
        snapshot: whether the state came from peer snapshots (``LiveState(snapshot_every=)``):
            no replica held some rank's shards, every rank went back to the newest step
            that a snapshot holds for every rank (``recomputed`` steps run again).
    """

    step: int | None
    fallback: str | None
    newest: int
    recomputed: int | None
    receivers: tuple[int, ...] = ()
    received_from: int | None = None
    nbytes: int = 0
    attempts: int = 0
    problems: tuple[str, ...] = ()
    seconds: float = 0.0
    transfer_seconds: float = 0.0
    snapshot: bool = False

    @property
    def live(self) -> bool:
        """Whether the state came from live replicas (no checkpoint needed)."""
        return self.fallback is None

    def timed(self, seconds: float) -> Recovery:
        return dataclasses.replace(self, seconds=seconds)
