"""A run whose trainer dies, and later whose driver dies, finishes with nothing lost or doubled.

The embedded job checkpoints every 8 steps. Its trainer actor is killed with SIGKILL once step 10 is logged: the
run restores the checkpoint of step 8 in the same command (trainer.max_restarts) and goes on. Its driver is then
killed with SIGKILL once step 18 is logged, past the checkpoint of step 16 with prompts in flight; `resume=true`
rewinds to step 16, retrains steps 17.. and admits the prompts the dead attempt had in flight again, exactly once.
One run, checked many ways: both rewinds, the fault log and counters, exactly-once training, the audit, learning,
and no process left behind.
"""

import json
import os
import signal

import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

from pipeline.observe.audit import audit
from tests.pipeline.test_faults import Run, assert_learns

STEPS = 32  # 256 prompts at 8 per step


def _checkpoint(run: Run) -> int:
    path = run.dir / "checkpoints" / "latest_checkpointed_iteration.txt"
    return int(path.read_text()) if path.exists() else 0


@pytest.mark.slow
def test_dead_trainer_restarts_in_the_command_and_a_dead_driver_resumes_losing_nothing(tmp_path):
    job = ("rollout.total_rollout_steps=256", "trainer.save_freq=8")
    first = Run(tmp_path, "faults", *job)
    first.wait_for(lambda: first.steps() >= 10 and _checkpoint(first) == 8)
    trainer = first.processes()["trainer"]
    os.kill(trainer, signal.SIGKILL)  # the trainer actor, by the PID the run recorded
    first.wait_for(lambda: first.processes()["trainer"] not in (0, trainer) and first.steps() >= 18)
    first.kill()  # the driver, past the checkpoint of step 16
    assert _checkpoint(first) == 16 and not (first.dir / "summary.json").exists()
    dead = pds.dataset(str(first.dir / "consumed")).to_table()
    assert max(dead["consumed_step"].to_pylist()) >= 17  # trained past the checkpoint

    second = Run(tmp_path, "faults", *job, "resume=true")
    second.finish()
    run_dir = second.dir
    (event,) = [json.loads(line) for line in (run_dir / "faults.jsonl").read_text().splitlines()]
    assert event["component"] == "trainer" and "died" in event["cause"] and event["from_step"] == 8
    assert "restarting the run from its checkpoint at step 8" in first.out.read_text()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))  # rewound twice: each step once
    assert [m["fault/trainer_restarts"] for m in metrics[8:16]] == [1.0] * 8  # the restarted attempt's steps

    consumed = pds.dataset(str(run_dir / "consumed")).to_table()
    assert sorted(set(consumed["consumed_step"].to_pylist())) == list(range(1, STEPS + 1))
    assert consumed.num_rows == len(set(consumed["sample_id"].to_pylist())) == STEPS * 8 * 8
    # What each dead attempt generated but had not consumed by its checkpoint: trained exactly once now.
    trained = consumed["prompt_id"].to_pylist()
    admitted = pq.read_table(run_dir / "admitted.parquet")["prompt_id"].to_pylist()
    assert len(admitted) == len(set(admitted))  # the final ledger admits no prompt twice
    for attempt in ("attempt-1", "attempt-2"):
        in_flight = set(
            pds.dataset(str(run_dir / "discarded" / attempt / "samples")).to_table()["prompt_id"].to_pylist()
        )
        assert in_flight, attempt
        for pid in in_flight & set(trained):
            assert trained.count(pid) == 8 and admitted.count(pid) == 1
    report = audit(run_dir)
    assert report.ok, report.table()
    assert_learns(metrics)
