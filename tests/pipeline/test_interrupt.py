"""Ctrl-C (SIGINT to the `asyncrl` command) in the middle of a run: it stops within seconds with one line that
says where it stopped and how to go on, ends the MLflow run as KILLED, writes what was done to summary.json, and
leaves no process behind, even when the command was started with SIGINT ignored. A simulated run
(conf/sim/toy.yaml): the real stream, Ray included, without a model."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.waiting import assert_gone, wait_until

ROOT = Path(__file__).resolve().parents[2]


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, err_log: Path, steps: int, timeout_s: float) -> None:
    def logged() -> bool:
        return metrics.exists() and len(metrics.read_text().splitlines()) >= steps

    def ended() -> str | None:
        return None if proc.poll() is None else f"the run ended early:\n{err_log.read_text()[-3000:]}"

    wait_until(logged, timeout_s, f"{steps} steps logged", give_up=ended)


def _signal_state(pid: int) -> str:
    """The process's ignored, blocked and caught signal masks, as the kernel reports them."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return ", ".join(line for line in lines if line.startswith(("SigIgn", "SigBlk", "SigCgt")))


@pytest.mark.slow
def test_ctrl_c_stops_with_one_line_marks_the_run_killed_and_leaves_nothing(tmp_path):
    run_dir = tmp_path / "ctrl-c"
    args = ["conf/sim/toy.yaml", "trainer.monitor=mlflow", f"trainer.output_dir={tmp_path}", "trainer.run_name=ctrl-c"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "pipeline.cli", "run", *args, "rollout.total_rollout_steps=1024"]  # 128 steps
    err_log = tmp_path / "stderr.txt"
    with open(err_log, "w") as err, open(tmp_path / "stdout.txt", "w") as out:  # files: a full pipe would block it
        # Started with SIGINT ignored, as a shell without job control starts a background job (and as a child of
        # a process that ignores it inherits): the run must still stop on it.
        ignore = lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)  # noqa: E731
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True, preexec_fn=ignore)
        try:
            _wait_for_steps(run_dir / "metrics.jsonl", proc, err_log, steps=3, timeout_s=240)
            started = psutil.Process(proc.pid).children(recursive=True)  # Ray's processes and its workers
            assert started, "a running job has child processes (Ray)"
            signals = _signal_state(proc.pid)  # for the message below, should SIGINT not stop it
            sent = time.monotonic()
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pytest.fail(f"SIGINT did not stop the run in 60 s; its signal state: {signals}")
            took = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
    stderr = err_log.read_text()
    assert proc.returncode == 130, stderr[-3000:]
    assert took < 30, f"stopping took {took:.1f} s"
    lines = [line for line in stderr.splitlines() if line.startswith("asyncrl:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert "interrupted at step" in lines[0] and "set trainer.save_freq" in lines[0], lines[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and summary["steps"] >= 3 and summary["resumable_from_step"] is None
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow/mlflow.db")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name("asyncrl").experiment_id])
    assert mlflow_run.info.status == "KILLED"
    assert_gone(started, 20)  # Ray's last processes exit on their own once its head is gone
