"""Child processes that never outlive the process that started them."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGKILL when ``parent_pid`` (its parent) dies, however it dies,
    so a killed server or engine leaves no orphan holding memory and cores. Elsewhere: nothing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the line above ran
        os._exit(1)
