"""The round outcome: one type, one encoding in the store, garbage read as the job's end."""

from __future__ import annotations

import json

import pytest

from trainguard.restart.state import RoundOutcome


def test_outcomes_round_trip_with_the_stored_field_names() -> None:
    fault = RoundOutcome.fault(3, "ValueError: boom (x.py:1 in f)", "ValueError")
    stored = json.loads(fault.encode())
    assert set(stored) == {"why", "rank", "error", "type", "time"}
    assert stored["why"] == "fault" and stored["rank"] == 3 and stored["type"] == "ValueError"
    assert RoundOutcome.decode(fault.encode()) == fault
    end = RoundOutcome.end("raised KeyboardInterrupt", rank=1, error="KeyboardInterrupt: ")
    assert json.loads(end.encode()) == {
        "why": "end",
        "rank": 1,
        "reason": "raised KeyboardInterrupt",
        "error": "KeyboardInterrupt: ",
    }
    assert RoundOutcome.decode(end.encode()) == end
    assert RoundOutcome.complete().encode() == b'{"why":"complete"}'
    assert RoundOutcome.decode('{"why":"complete","extra":1}') == RoundOutcome.complete()


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b"\xff\xfe", "not a JSON object"),
        (b"not json", "not a JSON object"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"why": "restart"}', "why='restart'"),
        (b'{"rank": 1}', "why=None"),
        (b'{"why": "fault", "rank": "1"}', "rank='1'"),
        (b'{"why": "fault", "rank": true}', "rank=True"),
        (b'{"why": "end", "reason": 5}', "reason=5"),
        (b'{"why": "fault", "time": "now"}', "time='now'"),
    ],
)
def test_garbage_decodes_to_the_end_of_the_job(raw: bytes, problem: str) -> None:
    outcome = RoundOutcome.decode(raw)
    assert outcome.why == "end" and outcome.rank is None
    assert outcome.reason is not None and "unreadable round outcome" in outcome.reason
    assert problem in outcome.reason
