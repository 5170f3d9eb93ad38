"""Key names and values of the coordination protocol.

Every key of a job starts with ``tg/<job token>/<call>/<secret>/``: the job token keeps two
jobs that share one store apart, the call index (how many wrapped calls this process made
before) keeps two successive wrapped calls of one job apart, and the job secret
(:mod:`trainguard.coord._secret`) keeps anyone who can reach the store but does not know the
secret from guessing any key name (a TCPStore cannot list its keys). Only the keys that hand
the secret over (:attr:`Keyspace.handover`) lie outside it. Keys of restart round ``n`` live under
``.../r<n>/`` so that a stale key of an old round can never satisfy a barrier of a new one;
:meth:`Keyspace.round_keys` lists every fixed key of a round so that it can be deleted.

Values are JSON (:func:`encode` / :func:`decode`) or plain counters (``Store.add``); never
pickle.

The launcher's keys (``trainguard launch``, one run of torchrun's agents) live under
:func:`launch_prefix`; the one of them that workers write too, the whole-job restart request
(:func:`escalate_key`, :mod:`trainguard.coord.escalation`), is named here, the others in
``trainguard/launch/_keys.py``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from trainguard import _env
from trainguard.errors import ConfigError

__all__ = ["Keyspace", "decode", "encode", "escalate_key", "launch_prefix"]


def encode(value: Any) -> bytes:
    """JSON bytes of ``value`` (compact, keys as given)."""
    return json.dumps(value, separators=(",", ":")).encode()


def decode(raw: bytes | str) -> Any:
    """Inverse of :func:`encode`."""
    return json.loads(raw)


class Keyspace:
    """Key names of one wrapped call of one job.

    Raises :class:`~trainguard.errors.ConfigError` (a ``ValueError``) for an empty token or one
    holding ``/``.

    Args:
        job: the job token (letters, digits, ``-_.``); shared by every rank of the job.
        call: index of the wrapped call within each process (0 for the first).
        secret: the job secret ("" for none: tests and tools that read a store).
    """

    def __init__(self, job: str, call: int = 0, secret: str = "") -> None:
        if not job or "/" in job:
            raise ConfigError(
                f"job token must be non-empty and contain no '/': {job!r}; set "
                "TRAINGUARD_JOB_ID to letters, digits and -_."
            )
        if "/" in secret:
            raise ConfigError("the job secret must contain no '/'; set TRAINGUARD_JOB_SECRET")
        self.job = job
        self.call = call
        self.secret = secret
        self.prefix = f"tg/{job}/{call}/{secret}/" if secret else f"tg/{job}/{call}/"

    def __repr__(self) -> str:  # never the secret: keyspaces end up in logs
        return f"Keyspace(job={self.job!r}, call={self.call})"

    def with_secret(self, secret: str) -> Keyspace:
        """The same call's keyspace under ``secret``."""
        return Keyspace(self.job, self.call, secret)

    @property
    def handover(self) -> str:
        """Outside the secret: where the secret, or a digest of it, is handed to the others."""
        return f"tg/{self.job}/{self.call}/secret"

    @property
    def ended(self) -> str:
        """Outside the secret: set once the job ended and its keys were deleted from an
        external store, so that a process that comes later (a respawned rank) learns that
        there is nothing left to join instead of waiting for keys that will never come."""
        return f"tg/{self.job}/{self.call}/ended"

    # job-level keys ---------------------------------------------------------------------
    @property
    def left(self) -> str:
        """Counter: how many initial ranks have left the job (for any reason)."""
        return self.prefix + "left"

    def left_mark(self, initial_rank: int) -> str:
        """Set once when ``initial_rank`` leaves the job: whoever sets it counts :attr:`left`."""
        return f"{self.prefix}left/{initial_rank}"

    @property
    def exit(self) -> str:
        """Set when every initial rank has left; the store process then exits."""
        return self.prefix + "exit"

    @property
    def latest(self) -> str:
        """JSON layout of the latest published round (a copy of its :meth:`ready` value, set
        by its publisher right after publishing): where a newcomer joining the running job
        starts (``restart/_join.py``)."""
        return self.prefix + "latest"

    @property
    def preempt_stop(self) -> str:
        """The step every rank stops at for a preemption (:mod:`trainguard.restart.preempt`;
        the first proposal wins, ``compare_set``): for the whole call, not one round, so that
        a round started before every rank read it still stops there."""
        return self.prefix + "preempt/stop"

    def preempt_done(self, initial_rank: int) -> str:
        """Set once ``initial_rank``'s function returned after saving the preemption step."""
        return f"{self.prefix}preempt/done/{initial_rank}"

    def pg_addr(self, n: int) -> str:
        """``host:port`` of the store that round ``n``'s process groups rendezvous on."""
        return f"{self.prefix}pg/{n}"

    def pg_standby(self, n: int) -> str:
        """``host:port`` of round ``n``'s store in the standby store process (on another host
        than the first one; :mod:`trainguard.coord._server`): where round ``n`` goes when the
        first one does not answer."""
        return f"{self.prefix}pg/{n}/standby"

    # round keys -------------------------------------------------------------------------
    def round_prefix(self, n: int) -> str:
        return f"{self.prefix}r{n}/"

    def arrive(self, n: int) -> str:
        """Counter of the ranks that reached round ``n``'s barrier (leavers included)."""
        return self.round_prefix(n) + "arrive"

    def pool(self, n: int) -> str:
        """Round ``n``'s barrier records, one JSON record a line (``append``): a rank's arrival
        (its host, fault, leaving...), its node watcher's for several ranks at once, a death
        notice's departure."""
        return self.round_prefix(n) + "pool"

    def ready(self, n: int) -> str:
        """JSON layout of round ``n`` set by the last arriver; completes the barrier."""
        return self.round_prefix(n) + "ready"

    def done(self, n: int) -> str:
        """Counter of active ranks whose function returned in round ``n``."""
        return self.round_prefix(n) + "done"

    def stop(self, n: int) -> str:
        """JSON outcome of round ``n``: the first of fault / complete / end wins (compare_set)."""
        return self.round_prefix(n) + "stop"

    def round_keys(self, n: int) -> list[str]:
        """Every key round ``n`` may have created, for deletion (its pool of records among
        them)."""
        return [self.arrive(n), self.ready(n), self.done(n), self.stop(n), self.pool(n)]

    def node_heartbeat(self, leader: int) -> str:
        """Counter of the node whose lowest watched rank is ``leader``, after the list of the
        ranks it watches (node liveness, ``bye`` once it has none left)."""
        return f"{self.prefix}hbn/{leader}"


def launch_prefix(run_id: str) -> str:
    """``trainguard/launch/<run_id>/[<secret digest>/]``: every launcher key of one run starts
    with it. With ``TRAINGUARD_JOB_SECRET`` set (required for a job on several hosts; the launcher
    hands it to its workers) the prefix carries a digest of it, so that nobody who can reach the
    stores but does not know the secret can name, read or forge a key of the job."""
    secret = _env.settings().job_secret
    if secret is None:
        return f"trainguard/launch/{run_id}/"
    digest = hashlib.sha256(f"trainguard-launch/{run_id}/{secret}".encode()).hexdigest()[:32]
    return f"trainguard/launch/{run_id}/{digest}/"


def escalate_key(run_id: str, generation: int) -> str:
    """Set (first reason wins) when a whole-job restart of ``generation`` is asked for."""
    return f"{launch_prefix(run_id)}escalate/g{generation}"
