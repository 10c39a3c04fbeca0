"""Two guards on the stream's tests, so that one failing test neither hides nor takes the rest of the suite with it.

- A failure is printed the moment it happens (the test, the phase, its time and the end of its traceback), not only in
  the summary at the end: a run that CI stops at its time limit still shows what failed and why.
- Every process a test's call starts carries ASYNCRL_TEST_MARK (the environment is inherited by a run's Ray, its
  actors and its engine cores). Once the call is over, a marked process that outlives it by GRACE_S is ended by its
  PID and the test fails naming it: a run left behind would otherwise spin beside every later test and slow them
  past their timeouts. Processes of fixtures (the suite's Ray session, a shared run) carry no mark of a test.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import psutil
import pytest

from tests.waiting import running

MARK = "ASYNCRL_TEST_MARK"
GRACE_S = 60.0  # a run's Ray processes end on their own once its head is gone; seconds on a loaded machine
GUARDED = ("distributed", "pipeline", "gpu")  # the unit and CLI tests start no run that can outlive them
TRACEBACK_CHARS = 3000


def marked(token: str) -> list[psutil.Process]:
    """The running processes of this user whose environment holds the mark `token`."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(MARK) == token and running(proc):
                found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def end(procs: list[psutil.Process]) -> list[str]:
    """SIGKILL to each process by its PID; returns what each was."""
    named = []
    for proc in procs:
        try:
            named.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return named


def left_after(token: str, grace_s: float) -> list[str]:
    """The marked processes still running `grace_s` after the call, ended; empty when all ended on their own."""
    deadline = time.monotonic() + grace_s
    while (procs := marked(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return end(procs)


class Reaper:
    """The plugin: registered by tests/conftest.py."""

    def __init__(self, config) -> None:
        self.config = config

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        if not any(f"/tests/{folder}/" in str(item.fspath) for folder in GUARDED):
            return (yield)
        token = uuid.uuid4().hex
        os.environ[MARK] = token
        try:
            result = yield
        finally:
            del os.environ[MARK]
            left = left_after(token, GRACE_S)
        if left:
            pytest.fail(f"processes this test started outlived it by {GRACE_S:.0f} s and were ended: {left}")
        return result

    def pytest_runtest_logreport(self, report):
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if not report.failed or reporter is None:
            return
        reporter.write_line("")
        reporter.write_line(f"FAILED {report.nodeid} ({report.when}, {report.duration:.0f} s):", red=True, bold=True)
        for line in report.longreprtext[-TRACEBACK_CHARS:].splitlines():
            reporter.write_line(f"    {line}")
