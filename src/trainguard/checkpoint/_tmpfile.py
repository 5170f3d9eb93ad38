"""The old home of :mod:`.format.tmpfile`, kept for :mod:`.dcp` until it imports from there.

``checkpoint/dcp/`` is edited on another branch while the file format moves into
:mod:`.format`; once both are merged, its imports move to :mod:`.format.tmpfile` and this
module goes.
"""

from __future__ import annotations

from trainguard.checkpoint.format.tmpfile import (
    create,
    discard,
    leftovers,
    publish,
    remove_leftovers,
    seal,
)

__all__ = ["create", "discard", "leftovers", "publish", "remove_leftovers", "seal"]
