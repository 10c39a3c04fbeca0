"""Two guards on the stream's tests, so that one failing test neither hides nor takes the rest of the suite with it.

- A failure is printed the moment it happens (the test, the phase, its time and the end of its traceback), not only in
  the summary at the end: a run that CI stops at its time limit still shows what failed and why.
- What a test's call leaves running is ended and fails the test: a run left behind would spin beside every later
  test (vLLM's engine cores poll) and slow them past their timeouts. Two kinds: a process that carries the call's
  ASYNCRL_TEST_MARK (set in the environment that a subprocess run, its own Ray, its actors and its engine cores
  inherit), and an actor of a run on the suite's Ray session (`RUN_ACTORS`: the session's workers are this process's
  descendants but inherit the session's environment, not the call's) that was not there when the call began.
  Whatever is still running GRACE_S after the call is ended by its PID. What fixtures started (the suite's Ray
  session, a shared run's server) is older than the call or unmarked, and left alone.
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
TRACEBACK_CHARS = 3000
# The process titles of a run's actors and engines on a Ray session it did not start (Ray Data's actor pools are
# MapWorkers; Ray's own actors, idle workers and Ray Data's helpers are not a run's).
RUN_ACTORS = (
    "ray::MapWorker(",
    "ray::TokenTables",
    "ray::VersionClock",
    "ray::Trainer",
    "ray::TorchTrainer",
    "ray::MegatronRank",
    "ray::SimTrainer",
    "VLLM",
)

# Python's own helper processes, started for the test process on first use and shared by every later test.
HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def marked(token: str) -> list[psutil.Process]:
    """The running processes of this user whose environment holds the mark `token`, but for the helpers that Python's
    multiprocessing starts for this process once and keeps (its resource tracker, its forkserver)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.environ().get(MARK) != token or not running(proc):
                continue
            if proc.ppid() == os.getpid() and any(helper in arg for arg in proc.cmdline() for helper in HELPERS):
                continue
            found.append(proc)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def titles() -> dict[int, str]:
    """This process's running descendants: PID -> command line (a Ray worker's is its process title)."""
    return {proc.pid: title for proc, title in _descendants()}


def run_actors(before: dict[int, str]) -> list[psutil.Process]:
    """This process's descendants that are a run's actors or engines now and were not in `before` (an idle worker
    that took an actor was there, under another title)."""
    return [
        proc
        for proc, title in _descendants()
        if title.startswith(RUN_ACTORS) and not before.get(proc.pid, "").startswith(RUN_ACTORS)
    ]


def _descendants() -> list[tuple[psutil.Process, str]]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if running(proc):
                found.append((proc, " ".join(proc.cmdline())))
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return found


def leftovers(token: str, before: dict[int, str]) -> list[psutil.Process]:
    """The call's marked processes and the run actors it started, each once."""
    found = {proc.pid: proc for proc in marked(token)}
    for proc in run_actors(before):
        found.setdefault(proc.pid, proc)
    return list(found.values())


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


def left_after(token: str, grace_s: float, before: dict[int, str] | None = None) -> list[str]:
    """What the call marked `token` left running `grace_s` after it (its marked processes, and the run actors that
    were not in `before`), ended; empty when all ended on their own."""
    deadline = time.monotonic() + grace_s
    while (procs := leftovers(token, before or {})) and time.monotonic() < deadline:
        time.sleep(0.5)
    return end(procs)


class Reaper:
    """The plugin: registered by tests/conftest.py, which tells the tests to guard (`guarded(item)`)."""

    def __init__(self, config, guarded) -> None:
        self.config, self.guarded = config, guarded

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        if not self.guarded(item):
            return (yield)
        token, before = uuid.uuid4().hex, titles()
        os.environ[MARK] = token
        try:
            result = yield
        finally:
            del os.environ[MARK]
            left = left_after(token, GRACE_S, before)
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
