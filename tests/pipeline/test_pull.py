"""Pull weight sync (a parameter store, as in StreamRL): the trainer publishes each version and goes on; every
replica loads the newest at its own safe point. Replicas run different versions at the same moment and the audit
stays exact."""

import json
from pathlib import Path

import pyarrow.dataset as pds
import pytest

SIM_CONFIG = str(Path(__file__).resolve().parents[2] / "conf" / "sim" / "toy.yaml")


def _loads(run_dir):
    return [json.loads(line) for line in (run_dir / "weight_loads.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_pull_with_two_vllm_replicas_passes_the_audit(run_job):
    summary, run_dir = run_job(
        "weight_sync.mode=pull",
        "rollout.num_replicas=2",
        "rollout.total_rollout_steps=96",  # 12 steps of 8 prompts
        "model.warm_start_steps=50",
        "trainer.monitor=jsonl",
        name="pulled",
    )
    assert summary["audit_ok"] and summary["steps"] == 12
    loads = _loads(run_dir)
    assert {(load["replica"], load["version"]) for load in loads} >= {(0, 12), (1, 12)}  # both reached the last
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sync/trainer_blocked_s"] < 5.0 for r in rows)  # a file write, not a round trip to the engines
    samples = pds.dataset(str(run_dir / "samples")).to_table(columns=["replica", "param_version_end"]).to_pylist()
    for replica in (0, 1):  # each replica generated with weights it pulled, not only the initial ones
        assert max(s["param_version_end"] for s in samples if s["replica"] == replica) >= 1


@pytest.mark.slow
def test_pull_replicas_hold_different_versions_at_once_within_the_bound(run_job):
    # Simulated engines, long-tailed responses, no partial rollout: a replica loads a new version only once its
    # requests in flight are done, so one replica drains a long response on old weights while the other runs new.
    summary, run_dir = run_job(
        "weight_sync.mode=pull",
        "rollout.num_replicas=2",
        "rollout.total_rollout_steps=96",
        "rollout.prompts_per_call=1",
        "rollout.calls_in_flight=4",
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        "async_training.staleness_threshold=1.0",
        "async_training.partial_rollout=false",
        "sim.length_sigma=1.2",
        "sim.length_mean=600",
        "sim.token_unit=8",
        "sim.time_scale=0.004",
        "sim.decode_s_per_token=0.05",  # a typical response 30 s, the long ones minutes: longer than a step
        "sim.train_s_per_token=0.002",  # a step of 16 responses about 20 s
        config=SIM_CONFIG,
        name="pulled_sim",
    )
    assert summary["audit_ok"], (run_dir / "audit.txt").read_text()
    assert summary["max_lag"] <= summary["lag_bound"] == 1
    samples = pds.dataset(str(run_dir / "samples")).to_table().to_pylist()
    spans = [
        (s["replica"], s["generated_time"] - s["gen_latency_s"], s["generated_time"], set(s["token_param_version"]))
        for s in samples
    ]
    overlapping = [
        (a, b)
        for a in spans
        for b in spans
        if a[0] == 0 and b[0] == 1 and a[1] < b[2] and b[1] < a[2] and (min(a[3]) > max(b[3]) or min(b[3]) > max(a[3]))
    ]
    assert overlapping, "no moment where the two replicas generated with different weights"
    loads = _loads(run_dir)
    times = {(load["replica"], load["version"]): load["loaded_at"] for load in loads}
    assert any(abs(times[(0, v)] - times[(1, v)]) > 0.01 for r, v in times if r == 0 and (1, v) in times)
