"""Serial validation on the embedded task (verl's parallel_validate_and_rollout=false): no training request starts
on a replica while it validates. The run is the default job (staleness 0.5, no partial rollout): it also carries the
checks of verl's async mode with stale samples (test_modes.py).

Validation interleaved with the stream is checked in test_learning.py's run, on a dedicated engine beside a pulling
stream in test_pull.py's."""

import pyarrow.parquet as pq
import pytest

from tests.pipeline.test_modes import check_mode

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


@pytest.mark.slow
def test_serial_validation_holds_new_training_requests(run_job):
    """parallel_validate_and_rollout=false: no training request starts on a replica while it validates."""
    summary, run_dir = run_job(
        *SHORT,
        "async_training.staleness_threshold=0.5",
        "async_training.parallel_validate_and_rollout=false",
        name="serial",
    )
    assert summary["audit_ok"] and summary["steps"] == 16
    check_mode(summary, run_dir, s=0.5, k=1, prompts=128, per_step=8, n=8)
    training = pq.read_table(run_dir / "samples", columns=["generated_time", "gen_latency_s"]).to_pylist()
    starts = [r["generated_time"] - r["gen_latency_s"] for r in training]
    windows = {}
    for version in (0, 8, 16):
        table = pq.read_table(run_dir / "validation" / f"version-{version:06d}.parquet").to_pylist()
        windows[version] = min(r["started_time"] for r in table), max(r["generated_time"] for r in table)
        begin, end = windows[version]
        inside = [s for s in starts if begin + 0.05 < s < end - 0.05]
        assert not inside, (version, begin, end, inside[:3])
    begin, end = windows[8]
    assert min(starts) < begin and max(starts) > end  # the stream generated on both sides of the middle pass
