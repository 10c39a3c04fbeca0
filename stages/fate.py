"""A child process that dies with its parent: the kernel SIGKILLs it when the parent dies (Linux's
PR_SET_PDEATHSIG), whatever the child is doing. Used by the reward stage's scoring workers (stages/reward.py) and by
a vLLM engine core forked from its forkserver (stages/engines/vllm_core.py)."""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any


def _find_prctl() -> Any:
    # Resolved at import, not after a fork: dlopen in the child of a multi-threaded process can deadlock.
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _find_prctl()


def die_with(parent_pid: int) -> None:
    """Called in the child: SIGKILL this process when `parent_pid`, its parent, dies; exit now if it has died
    already. A no-op where prctl is missing (not Linux)."""
    if _PRCTL is None:
        return
    _PRCTL(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(1)
