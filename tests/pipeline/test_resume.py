"""Kill a run mid-way (its driver, by PID), resume it, and prove from the logs that nothing was lost or doubled.

The run checkpoints every 2 steps. The driver is killed with SIGKILL once step 5 is logged, so the dead attempt
has trained past its last checkpoint (step 4) with prompts in flight. `resume=true` rewinds to step 4: the
resumed attempt retrains steps 5.. and admits the prompts the dead attempt had in flight again, exactly once.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

from pipeline.observe.audit import audit

ROOT = Path(__file__).resolve().parents[2]
# 50 prompts at 4 per step: 12 steps, sync every step, a checkpoint every 2.
JOB = [
    "rollout.total_rollout_steps=50",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=4",
    "data.max_response_length=24",
    "model.warm_start_steps=10",
    "data.num_embedded_prompts=200",
    "trainer.save_freq=2",
    "trainer.run_name=killed",
    "ray.no_progress_timeout_s=600",
]


def _asyncrl(tmp_path: Path, *extra: str) -> subprocess.Popen:
    # A short Ray temp dir of its own: socket paths must stay under ~107 characters.
    env = {**os.environ, "ASYNCRL_RAY_TMP": tempfile.mkdtemp(prefix="arr-", dir="/tmp"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pipeline.cli", "run", "conf/default.yaml", *JOB, f"trainer.output_dir={tmp_path}"]
    # Its own session: whatever the driver leaves behind when killed can be ended by the group we started.
    return subprocess.Popen([*cmd, *extra], cwd=ROOT, env=env, start_new_session=True)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _end_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process group of the driver we started, nothing else
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_kill_and_resume_loses_nothing(tmp_path):
    run_dir = tmp_path / "killed"
    first = _asyncrl(tmp_path)
    try:
        deadline = time.monotonic() + 900
        while _steps_logged(run_dir) < 5:
            assert first.poll() is None, "the first attempt ended before it could be killed"
            assert time.monotonic() < deadline, "the first attempt made no progress"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # the driver, by its PID
        first.wait(30)
    finally:
        time.sleep(2)  # Ray's own reaper ends the local cluster of a dead driver; end any straggler of ours
        _end_group(first)
    assert not (run_dir / "summary.json").exists()
    dead_consumed = pds.dataset(str(run_dir / "consumed")).to_table()
    assert max(dead_consumed["consumed_step"].to_pylist()) >= 5  # trained past the checkpoint at step 4

    second = _asyncrl(tmp_path, "resume=true")
    try:
        assert second.wait(900) == 0
    finally:
        _end_group(second)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["audit_ok"]
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # continuous, each once
    consumed = pds.dataset(str(run_dir / "consumed")).to_table()
    assert sorted(set(consumed["consumed_step"].to_pylist())) == list(range(1, 13))
    assert consumed.num_rows == len(set(consumed["sample_id"].to_pylist())) == 12 * 4 * 4

    # The prompts the dead attempt generated but had not consumed by the checkpoint: trained exactly once now.
    discarded = pds.dataset(str(run_dir / "discarded" / "attempt-1" / "samples")).to_table()
    in_flight = set(discarded["prompt_id"].to_pylist())
    assert in_flight
    trained = consumed["prompt_id"].to_pylist()
    admitted = pq.read_table(run_dir / "admitted.parquet")["prompt_id"].to_pylist()
    assert len(admitted) == len(set(admitted))  # the final ledger admits no prompt twice
    for pid in in_flight & set(trained):
        assert trained.count(pid) == 4 and admitted.count(pid) == 1
    report = audit(run_dir)
    assert report.ok, report.table()
