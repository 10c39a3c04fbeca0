"""Waiting for an event that another process (or thread) makes happen: the tests poll the event itself, a step
logged, a process gone, a server healthy, and never sleep a fixed time on the assumption that it has happened.

This is the one place where a test sleeps to wait: between two looks at the event, for `poll_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import psutil
import pytest

T = TypeVar("T")


def wait_until(
    event: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    poll_s: float = 0.2,
    give_up: Callable[[], str | None] | None = None,
) -> T:
    """The first truthy value of `event()`, polled every `poll_s`; the test fails naming `what` (a text, or a
    function that tells what is still missing) after `timeout_s`, or as soon as `give_up()` returns a reason (the
    process that should make it happen has ended, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = event()
        if found:
            return found
        reason = give_up() if give_up is not None else None
        if reason or time.monotonic() > deadline:
            pytest.fail(f"{what() if callable(what) else what}: {reason or f'not within {timeout_s:.0f} s'}")
        time.sleep(poll_s)


def running(proc: psutil.Process) -> bool:
    """Whether `proc` still runs (a zombie waiting for a reaper that is not ours has ended)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(procs, timeout_s: float) -> None:
    """Every process of `procs` ends within `timeout_s` (is_running also tells a reused PID from ours)."""
    procs = list(procs)
    left = lambda: [p.pid for p in procs if running(p)]  # noqa: E731
    wait_until(lambda: not left(), timeout_s, lambda: f"processes of the run still running: {left()}", poll_s=0.5)
