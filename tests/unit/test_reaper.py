"""The suite's process reaper (tests/reaper.py): a marked process that outlives its test is found and ended by its PID;
one that ends by itself, or carries another test's mark, is left alone."""

import os
import subprocess
import sys
import uuid

from tests.reaper import MARK, left_after, marked


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
