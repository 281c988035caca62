"""What every encoding shares: how a decoding program is compiled once when several
threads reach it (:func:`alone`).
"""

from __future__ import annotations

import threading
from typing import Any

_ALONE: dict[int, threading.Lock] = {}
_ALONE_GUARD = threading.Lock()


def alone(program: Any) -> threading.Lock:
    """A lock of ``program``'s own: its first call compiles it, and a second thread's
    call of the same program waits for that compile rather than compiling it again."""
    with _ALONE_GUARD:
        return _ALONE.setdefault(id(program), threading.Lock())
