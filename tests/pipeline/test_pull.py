"""Pull weight sync (a parameter store, as in StreamRL): the trainer publishes each version and goes on; every
replica loads the newest at its own safe point. Replicas run different versions at the same moment and the audit
stays exact.

The vLLM run also validates on a dedicated engine (verl's use_trainer_do_validate): an engine outside the stream
validates each version from its weight file, and the stream's engines, pulling their weights, never generate a
validation sample."""

import json
import os
from pathlib import Path

import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest

SHORT = [
    "rollout.total_rollout_steps=128",  # 16 steps of 8 prompts
    "model.warm_start_steps=100",
    "data.val_files=embedded",
    "data.num_embedded_val_prompts=16",
    "rollout.test_freq=8",
    "trainer.val_before_train=true",
    "rollout.val_kwargs.n=2",
    "trainer.monitor=jsonl",
]
SIM_CONFIG = str(Path(__file__).resolve().parents[2] / "conf" / "sim" / "toy.yaml")


def _loads(run_dir):
    return [json.loads(line) for line in (run_dir / "weight_loads.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_vllm_replicas_pull_and_a_dedicated_engine_validates(run_job):
    summary, run_dir = run_job(
        "weight_sync.mode=pull",
        "rollout.num_replicas=2",
        *SHORT,  # 16 steps of 8 prompts, validated before the first step and at versions 8 and 16
        "async_training.use_trainer_do_validate=true",
        name="pulled",
    )
    assert summary["audit_ok"] and summary["steps"] == 16, (run_dir / "audit.txt").read_text()
    loads = _loads(run_dir)
    assert {(load["replica"], load["version"]) for load in loads} >= {(0, 16), (1, 16)}  # both reached the last
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sync/trainer_blocked_s"] < 5.0 for r in rows)  # a file write, not a round trip to the engines
    samples = pds.dataset(str(run_dir / "samples")).to_table(columns=["replica", "param_version_end"]).to_pylist()
    assert len(samples) == 128 * 8 and {s["replica"] for s in samples} == {0, 1}  # no validation sample here
    for replica in (0, 1):  # each replica generated with weights it pulled, not only the initial ones
        assert max(s["param_version_end"] for s in samples if s["replica"] == replica) >= 1

    passes = [json.loads(line) for line in (run_dir / "validation" / "metrics.jsonl").read_text().splitlines()]
    assert [int(p["val/version"]) for p in passes] == [0, 8, 16]
    for version in (0, 8, 16):
        table = pq.read_table(run_dir / "validation" / f"version-{version:06d}.parquet")
        assert table.num_rows == 16 * 2
        assert set(table["replica"].to_pylist()) == {-1}  # the dedicated engine
        assert {v for tokens in table["token_param_version"].to_pylist() for v in tokens} == {version}
    assert sum("val/trainer_blocked_s" in r for r in rows) == 2  # versions 8 and 16 (0: before the first step)
    assert not Path(f"/dev/shm/asyncrl-dedicated-{os.getpid()}").exists()  # the weight files are gone


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
