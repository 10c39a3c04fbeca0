"""An engine over two tensor-parallel ranks (rollout.tensor_model_parallel_size=2; on CPU two worker processes, a
core each): the embedded job runs and passes its audit and verl's on-policy mode's checks (tests/pipeline/modes.py),
and a weight sync reaches both ranks.

The job is synchronous (staleness 0) and recomputes the engine's logprobs in the trainer (compute_prox_log_prob), so
every step compares the engine's logprobs at version v with the trainer's own at v: they agree only if both ranks
loaded every pushed version. Then, on the job's model, a trainer pushes to a TP = 2 engine directly: the engine's
logprobs equal the trainer's after a real update, and each worker's shard of a filled weight holds what the trainer
sent (the checksums of both workers, read through collective_rpc).
"""

import json
import math

import pyarrow as pa
import pytest

from pipeline import sync
from pipeline.clock import VersionClock
from stages.generate import VLLMGenerate
from stages.staleness import StalenessBudget
from stages.trainer.settings import PolicySettings
from stages.trainer.torch_backend import TorchTrainer
from tests.pipeline.engine_checks import TOL, prompts
from tests.pipeline.modes import check_mode

TP = 2


@pytest.mark.slow
def test_an_engine_over_two_ranks_runs_the_job_and_takes_every_push(run_job, tmp_path):
    summary, run_dir = run_job(
        f"rollout.tensor_model_parallel_size={TP}",
        "async_training.staleness_threshold=0",  # every sample comes from the trainer's current weights
        "async_training.compute_prox_log_prob=true",  # ... which recompute its logprobs: rollout_corr/*
        "rollout.total_rollout_steps=12",  # 3 steps of 4 prompts
        "actor.ppo_mini_batch_size=4",
        "rollout.n=4",
        "data.max_response_length=16",
        "model.warm_start_steps=10",
        "data.num_embedded_prompts=100",
        "trainer.monitor=jsonl",
        name="engine_tp",
    )
    assert summary["audit_ok"] and summary["steps"] == 3, (run_dir / "audit.txt").read_text()
    check_mode(summary, run_dir, s=0.0, k=1, prompts=12, per_step=4, n=4)  # verl's on-policy mode
    loads = [json.loads(line) for line in (run_dir / "weight_loads.jsonl").read_text().splitlines()]
    assert [(load["version"], load["engine_ranks"]) for load in loads] == [(1, TP), (2, TP), (3, TP)]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # steps 2 and 3 sampled with pushed weights: both ranks had loaded them
        gap = max(abs(row["rollout_corr/log_ppl_diff_max"]), abs(row["rollout_corr/log_ppl_diff_min"]))
        assert gap < TOL, (row["step"], gap)

    _push_reaches_both_ranks(run_dir / "model", tmp_path / "push")


def _push_reaches_both_ranks(model_dir, log_dir) -> None:
    import ray
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = (
        ray.remote(VersionClock)
        .options(name="clock-etp", namespace="etp", num_cpus=0, max_concurrency=100)
        .remote(StalenessBudget(0.0, 1, 1, 2), 1)
    )
    trainer = ray.remote(TorchTrainer).options(num_cpus=1).remote(str(model_dir), PolicySettings(lr=5e-2))
    engine = (
        ray.remote(VLLMGenerate)
        .options(num_cpus=1)
        .remote(str(model_dir), "clock-etp", "etp", n=2, max_tokens=8, max_model_len=128, tensor_parallel_size=TP)
    )
    batch = prompts(tokenizer, ["reverse: a b c =", "reverse: d e ="])

    def gap(out: pa.Table) -> float:
        recomputed = ray.get(trainer.logprobs.remote(out["prompt_ids"].to_pylist(), out["response_ids"].to_pylist()))
        engine_lp = out["response_logprobs"].to_pylist()
        return max(abs(a - b) for e, r in zip(engine_lp, recomputed, strict=True) for a, b in zip(e, r, strict=True))

    def checksums(name: str) -> list[float]:  # one per engine worker, in TP rank order
        rpc = lambda stage: stage.replica.run(stage.replica.engine.llm.collective_rpc("weight_checksum", args=(name,)))  # noqa: E731
        return ray.get(engine.__ray_call__.remote(rpc))

    try:
        before = ray.get(engine.__call__.remote(batch))
        assert gap(before) < TOL  # both ranks start from the model's weights
        advantage = [(-1.0) ** i for i in range(before.num_rows)]
        ray.get(trainer.train_step.remote([{**before.to_pydict(), "advantage": advantage}]))
        log_dir.mkdir()
        pusher = sync.Push(trainer, clock, 1, log_dir, engine_tp=TP)
        pusher.sync(1)
        assert gap(before) > 10 * TOL  # the trainer moved
        assert gap(ray.get(engine.__call__.remote(batch))) < TOL  # and the engine, on both ranks, with it

        # lm_head is split over the ranks by vocabulary rows (vLLM pads the vocabulary with zero rows first), the
        # final norm is whole on each. (A linear layer's `weight` is empty on CPU, its packed copy has no name.)
        sharded, replicated = "lm_head.weight", "model.norm.weight"
        meta = ray.get(trainer.weight_meta.remote())
        numel = {n: math.prod(s) for n, s in zip(meta.names, meta.shapes, strict=True)}
        assert sum(checksums(sharded)) != pytest.approx(0.25 * numel[sharded])
        ray.get(trainer.set_weight.remote(sharded, 0.25))
        ray.get(trainer.set_weight.remote(replicated, 0.5))
        pusher.sync(2)
        parts = checksums(sharded)
        assert len(parts) == TP and sum(parts) == pytest.approx(0.25 * numel[sharded])  # together the whole tensor
        assert all(0 < part < sum(parts) for part in parts)  # each rank a part of it
        assert checksums(replicated) == pytest.approx([0.5 * numel[replicated]] * TP)  # each rank all of it
    finally:
        for actor in (engine, trainer, clock):
            ray.kill(actor)
