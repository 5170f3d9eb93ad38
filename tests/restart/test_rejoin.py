"""A rank's new process joins the running job (real gloo, real SIGKILL, real store).

The respawn is what ``trainguard launch`` does (same RANK, ``TRAINGUARD_INCARNATION=1``),
done here by :meth:`RankGroup.respawn`. The launcher's death notice with ``returning=True``
is written by the test process itself against the job's store, as the launcher's agent
would: the victim then runs without a sidecar, so that nobody else writes a notice for it.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any

import pytest

import trainguard.restart as tr
from tests._dist import RankGroup, RankResult
from tests.restart import _faults, _jobs
from tests.restart._barrier_records import left_at, record_at
from trainguard.events import read_events

STEPS = 6
FAULT_STEP = 2
# Drawn once per pytest process: the two xdist workers may run tests of this file side by side,
# and with one fixed secret (a node watcher's address derives from it) and job id, one test's
# helpers answered the other's ranks (seen: a rank declared gone by another test's sidecar).
SECRET = f"rejoin-test-secret-{secrets.token_hex(8)}"
JOB = f"rejoin-{secrets.token_hex(4)}"
RESPAWN = {"TRAINGUARD_INCARNATION": "1"}
TIMEOUTS = {"store_timeout": 30, "soft_timeout": 5.0, "hard_timeout": 10.0}


def _started(tmp_path: Path, hold_round: int | None, overrides: Any, *, notice: bool = True):
    """A 3-rank job whose rank 1 SIGKILLs itself at FAULT_STEP of round 0, once it is dead.
    ``notice=False``: rank 1 runs without a sidecar (the test writes its death notice)."""
    group = RankGroup(
        _faults.fault_job,
        3,
        args=(STEPS, 1, FAULT_STEP, "sigkill", str(tmp_path), {**TIMEOUTS, **overrides}),
        kwargs={"victim_overrides": {} if notice else {"sidecar": False}, "hold_round": hold_round},
        timeout=60,
        env={"TRAINGUARD_JOB_SECRET": SECRET, "TRAINGUARD_JOB_ID": JOB},
    ).start()
    group.wait_until(lambda: not group.is_alive(1), timeout=40)
    return group


def _events(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path) if e["kind"] == kind]


def _rounds(result: RankResult) -> list[tuple[int, int, int]]:
    return [(x["round"], x["rank"], x["world"]) for x in result.get()["rounds"]]


def _notice(group: RankGroup, *, returning: bool) -> Any:
    """The launcher's death notice for rank 1, gone in round 0 of a 3-rank job."""
    from trainguard.coord.keys import Keyspace
    from trainguard.coord.store import connect
    from trainguard.restart.sidecar import SidecarConfig
    from trainguard.restart.sidecar._notice import write_notice

    cfg = SidecarConfig.build(
        tr.WrapperConfig(**{**_faults.TIMEOUTS, **TIMEOUTS}),
        rank=1,
        world=3,
        keys=Keyspace(JOB, 0, SECRET),
        addr=("127.0.0.1", group.port),
        log_dir=None,
    )
    store = connect("127.0.0.1", group.port, timeout=10)
    return write_notice(store, cfg, 1, 0, (0, 1, 2), "process died", returning=returning)


def test_respawn_joins_as_spare_after_the_spare_took_its_place(tmp_path: Path) -> None:
    overrides = {"rank_filter": tr.MaxActiveWorldSize(2), "rank_assignment": tr.FillGaps()}
    with _started(tmp_path, 1, overrides) as group:
        joiner = group.respawn(1, RESPAWN)
        group.wait_until(lambda: bool(_events(tmp_path, "join_wait")), timeout=40)
        assert group.is_alive(0) and group.is_alive(2)
        group.kill(2)  # the former spare, now active: the newcomer takes its place
        results = group.join()
    assert (results[1].exitcode, results[2].exitcode) == (-9, -9)
    expected = _jobs.reference(STEPS, 2)
    assert results[0].get()["weights"] == expected  # bit for bit: always 2 ranks
    assert results[joiner].get()["weights"] == expected
    assert _rounds(results[0]) == [(0, 0, 2), (1, 0, 2), (2, 0, 2)]
    assert _rounds(results[joiner]) == [(2, 1, 2)]
    [wait] = _events(tmp_path, "join_wait")
    assert (wait["rank"], wait["waiting_round"], wait["admit"]) == (1, 2, False)
    [admitted] = _events(tmp_path, "launch_admitted")
    assert (admitted["rank"], admitted["round"], admitted["incarnation"]) == (1, 2, 1)


def test_returning_notice_makes_the_barrier_wait_for_the_respawn(tmp_path: Path) -> None:
    with _started(tmp_path, None, {}, notice=False) as group:
        notice = _notice(group, returning=True)
        assert (notice.returning, notice.counted) == (True, False)
        respawned_at = time.time()
        joiner = group.respawn(1, RESPAWN)
        results = group.join()
    expected = _jobs.reference(STEPS, 3)  # world 3 throughout; the newcomer started afresh
    for index, rank in ((0, 0), (2, 2), (joiner, 1)):
        assert results[index].get()["weights"] == expected
        assert _rounds(results[index])[-1] == (1, rank, 3)
    assert results[0].get()["rounds"][1]["entered"] > respawned_at
    [admitted] = _events(tmp_path, "launch_admitted")
    assert (admitted["rank"], admitted["round"]) == (1, 1)


def test_newcomer_without_an_idle_spare_is_admitted_at_once(tmp_path: Path) -> None:
    overrides = {"rank_filter": tr.MaxActiveWorldSize(3), "rank_assignment": tr.FillGaps()}
    with _started(tmp_path, 1, overrides) as group:
        joiner = group.respawn(1, RESPAWN)
        results = group.join()
    expected = _jobs.reference(STEPS, 3)  # the newcomer has no checkpoint: all start afresh
    assert results[0].get()["weights"] == expected
    assert results[2].get()["weights"] == expected
    assert results[joiner].get()["weights"] == expected
    assert _rounds(results[0]) == [(0, 0, 3), (1, 0, 2), (2, 0, 3)]
    assert _rounds(results[2]) == [(0, 2, 3), (1, 1, 2), (2, 1, 3)]
    assert _rounds(results[joiner]) == [(2, 2, 3)]
    [wait] = _events(tmp_path, "join_wait")
    assert (wait["waiting_round"], wait["admit"]) == (2, True)
    aborts = [e for e in _events(tmp_path, "abort") if e["round"] == 1]
    assert aborts and all(e["cause"] == "admit" for e in aborts)


def test_returning_rank_that_never_comes_back_is_let_go(tmp_path: Path) -> None:
    with _started(tmp_path, None, {}, notice=False) as group:
        assert _notice(group, returning=True).returning
        time.sleep(1.0)  # the survivors wait at round 1's barrier for rank 1
        let_go = time.time()
        notice = _notice(group, returning=False)
        assert (notice.returning, notice.counted) == (False, True)
        results = group.join()
    expected = _jobs.reference(STEPS, 3, switch=FAULT_STEP, after=2)
    for rank, new_rank in ((0, 0), (2, 1)):
        value = results[rank].get()
        assert value["weights"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert _rounds(results[rank]) == [(0, rank, 3), (1, new_rank, 2)]
        assert value["rounds"][1]["entered"] > let_go


def _published_round_0(filter_: Any) -> tuple[Any, Any, Any]:
    """A real store holding round 0 of a 3-rank job as its ranks published it."""
    import torch.distributed as dist

    from trainguard.coord.keys import Keyspace
    from trainguard.restart._book import RoundBook
    from trainguard.restart._records import BarrierRecord
    from trainguard.restart.sidecar import SidecarConfig

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    keys = Keyspace("unit", 0, "s3cret")
    wcfg = tr.WrapperConfig(**{**_faults.TIMEOUTS, **TIMEOUTS, "rank_filter": filter_})
    cfg = SidecarConfig.build(
        wcfg, rank=1, world=3, keys=keys, addr=("127.0.0.1", store.port), log_dir=None
    )
    store.set(keys.pg_addr(0), "127.0.0.1:1")
    for r in range(3):
        book = RoundBook(store, keys, 3, wcfg.policies, store_timeout=5.0, writer=r)
        book.record(0, BarrierRecord(r, "h", r))
        raw = book.arrive(0)
    assert raw is not None and store.get(keys.latest) == raw  # the publisher copied it
    return store, keys, cfg


def test_returning_notice_with_an_idle_spare_is_an_ordinary_departure() -> None:
    from trainguard.restart.sidecar._notice import write_notice

    store, keys, cfg = _published_round_0(tr.MaxActiveWorldSize(2))  # active 0, 1; spare 2
    notice = write_notice(store, cfg, 1, 0, (0, 1, 2), "died", returning=True)
    assert (notice.returning, notice.counted) == (False, True)
    assert left_at(store, keys, 1, 1) == "died"


def test_returning_notice_without_a_spare_keeps_the_rank_until_let_go() -> None:
    from trainguard.restart._book import peek
    from trainguard.restart.sidecar._notice import write_notice
    from trainguard.restart.state import RoundOutcome

    store, keys, cfg = _published_round_0(None)  # 3 active, no spare
    notice = write_notice(store, cfg, 1, 0, (0, 1, 2), "died", returning=True)
    assert (notice.returning, notice.counted) == (True, False)
    stop = peek(store, keys.stop(0))
    assert stop is not None and RoundOutcome.decode(stop).why == "fault"  # survivors abort
    assert record_at(store, keys, 1, 1) is None  # its arrival is not taken
    assert peek(store, keys.left_mark(1)) is None  # nor is it counted out
    notice = write_notice(store, cfg, 1, 0, (0, 1, 2), "never came back", returning=False)
    assert (notice.returning, notice.counted) == (False, True)
    assert "never came back" in left_at(store, keys, 1, 1)


def test_layout_writer_admits_a_gone_rank_and_recounts_it_when_its_layout_loses() -> None:
    from trainguard.restart import _records
    from trainguard.restart._book import RoundBook, peek
    from trainguard.restart._records import BarrierRecord
    from trainguard.restart.sidecar._notice import write_notice

    store, keys, cfg = _published_round_0(None)
    write_notice(store, cfg, 1, 0, (0, 1, 2), "died")  # rank 1 is out: left = 1
    policies = cfg.round_policies()
    books = {r: RoundBook(store, keys, 3, policies, store_timeout=5.0, writer=r) for r in (0, 2)}
    store.set(keys.pg_addr(1), "127.0.0.1:1")
    store.set(keys.pg_addr(2), "127.0.0.1:1")
    for n in (1, 2):
        for r, book in books.items():
            book.enter(_records.layout(store.get(keys.ready(n - 1))))
            if n == 2 and r == 0:  # the newcomer's record, not counted (not in the roster)
                rec = BarrierRecord(1, "h", 1)
                books[0].record(2, rec)
            book.record(n, BarrierRecord(r, "h", r))
        if n == 1:
            assert books[0].arrive(1) is None and books[2].arrive(1) is not None
    payload, admitted = books[2]._lay_out(2)
    ready = _records.layout(payload)
    assert admitted == [1] and ready.active == [0, 2, 1] and ready.gone == {}
    assert peek(store, keys.left_mark(1)) is None and store.add(keys.left, 0) == 0
    # another writer published round 2 without it: this writer counts it out again
    other = payload.replace(b'"active":[0,2,1]', b'"active":[0,2]')
    books[2]._recount(admitted, other)
    assert peek(store, keys.left_mark(1)) is not None and store.add(keys.left, 0) == 1
    # a newcomer that dies while it waits outside the roster aborts no round
    write_notice(store, cfg, 1, 2, (0, 2), "died while waiting")
    assert peek(store, keys.stop(2)) is None


def test_a_newcomer_that_looks_after_the_next_round_was_published_follows_it() -> None:
    """A newcomer waits outside the roster for the running round's outcome. The others restart
    at once and the next round's publisher deletes the round's keys, its outcome among them:
    a newcomer that looks only then (woken but not scheduled, as on a loaded node) must take
    the published round, not read "the job completed" (a CI failure of the launch demo: the
    replacement node's second worker returned without ever joining)."""
    import threading

    from trainguard.restart import _records
    from trainguard.restart._book import RoundBook, peek
    from trainguard.restart._join import Newcomer
    from trainguard.restart._records import BarrierRecord
    from trainguard.restart.sidecar._notice import write_notice

    store, keys, cfg = _published_round_0(None)
    write_notice(store, cfg, 1, 0, (0, 1, 2), "died")  # round 0 is a fault; rank 1 out
    zero = _records.layout(store.get(keys.ready(0)))
    policies = cfg.round_policies()
    # the newcomer read round 0 as the latest and slept; meanwhile round 1 is published
    # without it, and its publisher deletes round 0's keys: the outcome it would wait for
    store.set(keys.pg_addr(1), "127.0.0.1:1")
    for r in (0, 2):
        book = RoundBook(store, keys, 3, policies, store_timeout=5.0, writer=r)
        book.enter(zero)
        book.record(1, BarrierRecord(r, "h", r))
        book.arrive(1)
    assert peek(store, keys.stop(0)) is None
    one = _records.layout(store.get(keys.ready(1)))
    newcomer = RoundBook(store, keys, 3, policies, store_timeout=5.0, writer=1)
    newcomer.enter(zero)
    join = Newcomer(newcomer, BarrierRecord(1, "h", 1), barrier_timeout=30.0)
    waited: list[Any] = []
    thread = threading.Thread(target=lambda: waited.append(join._wait(1)), daemon=True)
    thread.start()
    thread.join(10)  # one slice (2 s) and a look; before the fix it waited until the job ended
    assert waited, "the newcomer still waits for the outcome of a round whose keys are gone"
    assert waited[0] is not None, "the newcomer took the round's deleted keys for the job's end"
    assert (waited[0].round, waited[0].active, waited[0].holds(1)) == (1, one.active, False)


def test_peeking_a_key_that_is_not_set_wakes_no_waiter() -> None:
    """A newcomer peeks the running round's outcome while the ranks of that round wait for it:
    the peek must not wake them (torch 2.13's TCPStore wakes waiters on a ``compare_set`` of a
    key that is not set, and the woken monitor then read an empty outcome)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from trainguard.restart._book import peek

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    peeker = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    waiter = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=True)
    woke: list[float] = []

    def wait() -> None:
        start = time.monotonic()
        try:
            waiter.wait(["outcome"], timedelta(seconds=1.5))
            woke.append(time.monotonic() - start)
        except Exception:
            pass  # the timeout: nothing woke it

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.2)
    assert peek(peeker, "outcome") is None
    thread.join(10)
    assert woke == [], f"the waiter woke {woke[0]:.2f} s after it began without a value"
    server.set("outcome", b"done")
    assert peek(peeker, "outcome") == b"done"


def _short_job() -> int | None:
    @tr.Wrapper(**TIMEOUTS, barrier_timeout=60)
    def train(call: tr.CallWrapper) -> int:
        return call.world_size

    return train()


@pytest.mark.parametrize("secret", ["file", "env"])
def test_a_respawn_that_comes_after_the_job_ended_returns_at_once(secret: str) -> None:
    """The launcher may respawn a rank that died just before the others finished: the new
    process must learn that the job is over (its keys were deleted from the external store)
    instead of waiting for a secret or a round that never comes."""
    import torch.distributed as dist

    from tests._dist import run_ranks
    from trainguard.coord.keys import Keyspace

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    env = {"TRAINGUARD_STORE_ADDR": f"127.0.0.1:{server.port}", "TRAINGUARD_JOB_ID": JOB}
    if secret == "env":
        env["TRAINGUARD_JOB_SECRET"] = SECRET
    assert [r.get() for r in run_ranks(_short_job, 2, env=env, timeout=60)] == [2, 2]
    assert server.check([Keyspace(JOB, 0).ended])
    start = time.monotonic()
    late = run_ranks(_short_job, 2, env={**env, **RESPAWN}, timeout=50)
    assert [r.get() for r in late] == [None, None]
    assert time.monotonic() - start < 30
