"""The admission gate around torch's c10d rendezvous, and the vacancies a replacement node takes.

**Gate.** torch's agent restarts every worker of the job as soon as its rendezvous handler
reports a node waiting (``num_nodes_waiting() > 0``, checked on each monitor tick). A replacement
or spare node that starts ``trainguard launch`` while the job runs ends up in that waiting list,
so under plain torch it would stop every running worker. :class:`AdmissionGate` delegates every
call to the c10d handler but reports waiting nodes only once the job's whole-job restart was
asked for (the escalation key of the current generation is set): the waiting nodes then join
the restart's new rendezvous round, and until then they wait.

**Vacancies.** Protocol between the agents of a running job and a replacement node, all in the
*rendezvous* store (the only store a new node reaches before any rendezvous round), key
``trainguard/launch/<run_id>/vacant``:

1. The agent that declared a node lost (its node ring's ``on_lost`` runs on exactly one
   agent, :func:`trainguard.launch.heartbeat.node_ring`) calls :func:`mark_vacant` with the
   lost node's group rank and what a newcomer needs to join the running generation.
2. A node that starts while the job runs calls :func:`claim_vacancy` before it joins any
   rendezvous round: it gets one vacancy (each vacancy goes to exactly one claimer) or ``None``
   (then it goes to the rendezvous and waits behind the gate).
3. When a new generation starts (whole-job restart), the group-rank-0 agent calls
   :func:`drop_vacancies` for the older generations: their group ranks are filled by the new
   rendezvous round.

The value is one JSON document ``{"by": <nonce>, "vacancies": [...]}``, changed only by
``compare_set`` loops; the fresh nonce of each write makes a write recognisable as one's own
(``compare_set`` answers with the current value, which could otherwise equal the one we meant
to write while another claimer wrote it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)

from trainguard.coord.store import StoreLike, as_store
from trainguard.errors import ConfigError, CoordinationError
from trainguard.launch._keys import escalate_key, vacant_key

__all__ = [
    "AdmissionGate",
    "Vacancy",
    "claim_vacancy",
    "create_gated_handler",
    "drop_vacancies",
    "mark_vacant",
    "vacancies",
]

logger = logging.getLogger(__name__)


class AdmissionGate(RendezvousHandler):
    """A :class:`RendezvousHandler` that delegates to ``handler`` and hides waiting nodes until a
    whole-job restart was asked for (see the module docstring).

    Args:
        handler: the c10d ``DynamicRendezvousHandler`` (any handler works).
        store: the rendezvous store the handler uses (unprefixed); the agent reads and writes
            the vacancy key there before and between rendezvous rounds.

    The agent calls :meth:`follow` after each rendezvous round with the store that holds the
    escalation key (the coordination store) and the round's generation. Before the first
    :meth:`follow` no escalation can have been asked for, so no node is reported waiting.
    """

    def __init__(self, handler: RendezvousHandler, store: StoreLike) -> None:
        self.handler = handler
        self.store = store
        self.coord: Any = None
        self.generation: int | None = None

    def follow(self, coord: Any, generation: int) -> None:
        """Check the escalation key of ``generation`` in ``coord`` from now on."""
        self.coord, self.generation = coord, generation

    def pause(self) -> None:
        """Stop checking (this node is cut off from the coordination store) until the next
        :meth:`follow`."""
        self.coord = None

    def escalated(self) -> bool:
        """True when the current generation's whole-job restart was asked for (one ``check``);
        False when the coordination store does not answer (the agent's fence deals with it)."""
        coord = self.coord
        if coord is None or self.generation is None:
            return False
        try:
            return bool(coord.check([escalate_key(self.get_run_id(), self.generation)]))
        except Exception as exc:
            logger.warning("the admission gate could not read the escalation key (%s)", exc)
            return False

    def num_nodes_waiting(self) -> int:
        """0 unless :meth:`escalated`; then the inner handler's count."""
        return self.handler.num_nodes_waiting() if self.escalated() else 0

    def get_backend(self) -> str:
        return self.handler.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.handler.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        return self.handler.next_rendezvous()

    def is_closed(self) -> bool:
        return self.handler.is_closed()

    def set_closed(self) -> None:
        self.handler.set_closed()

    def get_run_id(self) -> str:
        return self.handler.get_run_id()

    def shutdown(self) -> bool:
        return self.handler.shutdown()


def create_gated_handler(params: RendezvousParameters) -> AdmissionGate:
    """torch's c10d rendezvous handler for ``params`` (``--rdzv-backend=c10d``), wrapped in an
    :class:`AdmissionGate` whose ``store`` is the rendezvous store (connected, or hosted here
    when this node is the rendezvous host, as torch decides)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    if params.backend != "c10d":
        raise ConfigError(
            f"trainguard launch needs the c10d rendezvous (got --rdzv-backend={params.backend}); "
            "use --rdzv-backend=c10d"
        )
    backend, store = c10d_rendezvous_backend.create_backend(params)
    handler = dynamic_rendezvous.create_handler(store, backend, params)
    return AdmissionGate(handler, as_store(store))


@dataclasses.dataclass(frozen=True)
class Vacancy:
    """A group rank left by a lost node, and what a replacement needs to take it.

    ``node``: the group rank; ``generation``: the job's generation it belongs to; ``nodes``: the
    group world size; ``world_size``: the number of workers (global ranks) of the job;
    ``store_addr``: ``host:port`` of the coordination store; ``master_addr``/``master_port``:
    the ``MASTER_ADDR``/``MASTER_PORT`` the job's workers were given.
    """

    node: int
    generation: int
    nodes: int
    world_size: int
    store_addr: str
    master_addr: str
    master_port: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, value: object) -> Vacancy:
        """Raises ``ValueError``/``TypeError``/``KeyError`` for anything but a vacancy."""
        if not isinstance(value, dict) or set(value) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError(f"not a vacancy: {value!r:.200}")
        for field in dataclasses.fields(cls):
            kind = str if field.type in ("str", str) else int
            item = value[field.name]
            if isinstance(item, bool) or not isinstance(item, kind):
                raise TypeError(f"vacancy field {field.name}={item!r} is not {kind.__name__}")
        return cls(**value)


def _read(store: StoreLike, key: str) -> tuple[bytes, list[Vacancy]]:
    """The raw value under ``key`` (``b""`` when missing) and the vacancies it lists."""
    raw = bytes(store.get(key)) if store.check([key]) else b""
    return raw, _decode(key, raw)


def _decode(key: str, raw: bytes) -> list[Vacancy]:
    if not raw:
        return []
    try:
        doc = json.loads(raw)
        return [Vacancy.from_json(v) for v in doc["vacancies"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise CoordinationError(
            f"garbage under {key} in the rendezvous store ({exc}): {raw[:200]!r}; another "
            "program writes there: give this job its own --rdzv-id"
        ) from None


def _update(
    store: StoreLike, run_id: str, change: Callable[[list[Vacancy]], list[Vacancy] | None]
) -> list[Vacancy] | None:
    """Apply ``change`` to the vacancy list with ``compare_set`` until it lands; returns the
    list it was applied to, or ``None`` when ``change`` said there was nothing to do."""
    key = vacant_key(run_id)
    raw, current = _read(store, key)
    while True:
        new = change(current)
        if new is None:
            return None
        doc = {"by": uuid.uuid4().hex, "vacancies": [v.to_json() for v in new]}
        value = json.dumps(doc, separators=(",", ":")).encode()
        got = bytes(store.compare_set(key, raw, value))
        if got == value:
            return current
        # Somebody else wrote first: start over from their value. A TCPStore answers a missing
        # key with the expected value itself; the key is then really missing.
        raw = b"" if got == raw else got
        current = _decode(key, raw)


def mark_vacant(store: StoreLike, run_id: str, vacancy: Vacancy) -> None:
    """The agent that declared node ``vacancy.node`` lost: offer its group rank to a newcomer
    (in the rendezvous store). Marking the same node and generation again changes nothing."""

    def add(current: list[Vacancy]) -> list[Vacancy] | None:
        if any((v.node, v.generation) == (vacancy.node, vacancy.generation) for v in current):
            return None
        return [*current, vacancy]

    if _update(store, run_id, add) is not None:
        logger.info("group rank %d of generation %d is vacant", vacancy.node, vacancy.generation)


def claim_vacancy(store: StoreLike, run_id: str) -> Vacancy | None:
    """A node that starts while the job runs, before any rendezvous round: take the oldest
    vacancy, or ``None`` when there is none. Each vacancy goes to exactly one claimer."""
    taken = _update(store, run_id, lambda current: current[1:] if current else None)
    if taken is None:
        return None
    logger.info("claimed group rank %d of generation %d", taken[0].node, taken[0].generation)
    return taken[0]


def drop_vacancies(store: StoreLike, run_id: str, *, before: int) -> None:
    """The group-rank-0 agent when generation ``before`` starts: the vacancies of older
    generations are filled by the new rendezvous round; no newcomer may take them."""

    def drop(current: list[Vacancy]) -> list[Vacancy] | None:
        kept = [v for v in current if v.generation >= before]
        return kept if len(kept) != len(current) else None

    _update(store, run_id, drop)


def vacancies(store: StoreLike, run_id: str) -> list[Vacancy]:
    """The vacancies now offered (for logs and tests)."""
    return _read(store, vacant_key(run_id))[1]
