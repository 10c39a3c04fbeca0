"""The suite's process reaper (tests/reaper.py): a marked process, or a run's actor on the suite's Ray session, that
outlives its test is found and ended by its PID; one that ends by itself, carries another test's mark or was there
before the test is left alone."""

import os
import shutil
import subprocess
import sys
import uuid

from tests.reaper import MARK, left_after, marked, titles


def start(token: str, seconds: float) -> subprocess.Popen:
    code = f"import time; time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, MARK: token}, start_new_session=True)


def test_a_marked_process_left_running_is_named_and_ended():
    token, other = uuid.uuid4().hex, uuid.uuid4().hex
    stays, bystander = start(token, 600), start(other, 600)
    try:
        left = left_after(token, grace_s=0.5)
        assert [entry.split()[0] for entry in left] == [str(stays.pid)]
        assert stays.wait(10) == -9  # SIGKILL, by its PID
        assert bystander.poll() is None  # another mark: not this test's
        assert [p.pid for p in marked(other)] == [bystander.pid]
    finally:
        bystander.kill()
        bystander.wait(10)
        stays.kill()
        stays.wait(10)


def test_a_process_that_ends_within_the_grace_is_not_reported():
    token = uuid.uuid4().hex
    ends = start(token, 0.5)
    assert left_after(token, grace_s=30) == []
    assert ends.wait(10) == 0


def titled(title: str) -> subprocess.Popen:
    """A child process whose command line starts with `title`, as a Ray worker's process title does."""
    return subprocess.Popen([title, "600"], executable=shutil.which("sleep"))


def test_a_run_actor_started_during_the_call_is_ended_and_an_older_one_is_left():
    older = titled("ray::TokenTables")
    try:
        before = titles()
        new, idle = titled("ray::MapWorker(MapWorker(Generate))"), titled("ray::IDLE")
        left = left_after(uuid.uuid4().hex, grace_s=0.5, before=before)
        assert [entry.split()[0] for entry in left] == [str(new.pid)]
        assert new.wait(10) == -9
        assert older.poll() is None and idle.poll() is None  # a fixture's actor, and Ray's idle worker
    finally:
        for proc in (older, new, idle):
            proc.kill()
            proc.wait(10)


def test_pythons_own_helpers_of_the_test_process_are_left():
    token = uuid.uuid4().hex
    args = [sys.executable, "-c", "import time; time.sleep(600)", "from multiprocessing.resource_tracker import main"]
    helper = subprocess.Popen(args, env={**os.environ, MARK: token})
    try:
        assert marked(token) == []
    finally:
        helper.kill()
        helper.wait(10)
