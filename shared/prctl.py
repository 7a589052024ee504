"""prctl(2), for the process handling of the coordinator, its worker template and its workers (Linux).

A death signal makes a child die with its parent, even when the parent is SIGKILLed; a child subreaper adopts the
orphans of its descendants; a process name is what `ps`, `top` and psutil show (at most 15 bytes).
"""

from __future__ import annotations

import ctypes

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PR_SET_CHILD_SUBREAPER = 36


def prctl(option: int, value: int | bytes) -> bool:
    """Call prctl(option, value); False when it failed or the C library has none (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, value, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False
