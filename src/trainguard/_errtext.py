"""Error text for log lines: :func:`brief` cuts the C++ stack trace out of torch's messages.

torch's C++ errors (``c10::Error`` and its kin: ``DistBackendError``, ``DistNetworkError``)
carry their backtrace in the message when C++ stack traces are on: ``Exception raised from
... (most recent call first):`` then one ``frame #N: ...`` line per frame. A recovered fault
is one line at the default log level; the whole text still goes to the debug level and into
the event log.
"""

from __future__ import annotations

import re

__all__ = ["brief"]

_TRACE_START = re.compile(r"\s*Exception raised from \S.*?\(most recent call first\):", re.S)
_FRAME = re.compile(r"^\s*(frame #\d+:|<omitting python frames>)")


def brief(text: str) -> str:
    """``text`` without a C++ backtrace: what precedes ``Exception raised from ...``, and no
    ``frame #N:`` lines; the same text when it has none."""
    match = _TRACE_START.search(text)
    if match is not None:
        text = text[: match.start()] + " [C++ stack trace at debug level]"
    lines = [line for line in text.splitlines() if not _FRAME.match(line)]
    return "\n".join(lines).rstrip()
