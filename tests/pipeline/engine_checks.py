"""What the tests that drive a vLLM replica directly share: their prompt tables, waiting for an engine to decode, and
the check that weights really reach the engine (after a push, vLLM's logprobs equal the trainer's, token for token).

Tolerance: 1e-4 absolute on float32 logprobs (vLLM's CPU kernels and HF's eager attention differ in summation order;
measured differences are around 1e-6).
"""

import math
import os
import time

import numpy as np
import psutil
import pyarrow as pa

from tests.waiting import wait_until

TOL = 1e-4


def prompts(tokenizer, texts: list[str]) -> pa.Table:
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return pa.table(
        {
            "prompt_id": [f"p{i}" for i in range(len(texts))],
            "prompt_text": texts,
            "prompt_ids": pa.array(ids, pa.list_(pa.int32())),
            "ground_truth": [""] * len(texts),
            "data_source": ["reverse"] * len(texts),
            "admitted_version": pa.array([0] * len(texts), pa.int64()),
            "admitted_time": [time.time()] * len(texts),
        }
    )


def check_the_model_runs_in_the_engine_core(ray, engine) -> None:
    """A started one-rank CPU engine: the replica's actor has two processes under it, a forkserver and the engine
    core forked from it, which runs the model itself (no worker process below it) with multiprocessing off and vLLM's
    thread count (the cores less one); the actor's own environment is as it was; its KV cache is fitted; its
    statistics are off."""

    def read(stage) -> tuple[int, list[int], str | None, dict]:
        from stages.engines.vllm import engine_pids

        config = stage.replica.engine.llm.vllm_config
        cache = {
            "blocks": config.cache_config.num_gpu_blocks,
            "block_size": config.cache_config.block_size,
            "bytes": config.cache_config.kv_cache_memory_bytes,
            "seqs": config.scheduler_config.max_num_seqs,
            "max_model_len": config.model_config.max_model_len,
            "log_stats": stage.replica.engine.llm.log_stats,
        }
        pids = engine_pids(stage.replica.engine.llm)
        return os.getpid(), pids, os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING"), cache

    actor, cores, actor_env, cache = ray.get(engine.__ray_call__.remote(read))
    descendants = {
        p.pid: p for p in psutil.Process(actor).children(recursive=True) if "resource_tracker" not in p.cmdline()[-1]
    }
    layout = [(p.pid, p.ppid(), p.cmdline()[-1][:60]) for p in descendants.values()]
    assert len(cores) == 1 and len(descendants) == 2 and cores[0] in descendants, layout
    server = descendants[cores[0]].parent()
    assert server.pid in descendants and server.ppid() == actor and "forkserver" in server.cmdline()[-1], layout
    env = psutil.Process(cores[0]).environ()
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(cores[0])) - 1))
    assert actor_env is None
    # Its KV cache is fitted (stages/engines/vllm_core.py, kv_cache_bytes): every sequence it may run at once has
    # room at full length, and it takes a fraction of the fixed 1 GiB it had before.
    per_sequence = -(-cache["max_model_len"] // cache["block_size"])
    assert cache["blocks"] >= cache["seqs"] * per_sequence, cache
    assert cache["bytes"] <= (1 << 30) // 8, cache
    assert cache["log_stats"] is False  # vLLM's per-step statistics are off (rollout.disable_log_stats, verl's default)


def decoding(ray, engine) -> int:
    """How many of the engine's requests are past their first token (vLLM's per-request state, read in the Generate
    actor's process): a weight sync pushed now lands in the middle of responses."""

    def count(stage) -> int:
        states = list(stage.replica.engine.llm.output_processor.request_states.values())
        return sum(not state.is_prefilling for state in states)

    return ray.get(engine.__ray_call__.remote(count))


def wait_until_decoding(ray, engine, pending) -> None:
    """Wait until the engine decodes some of `pending`'s responses; fails if the call ends first."""
    wait_until(
        lambda: decoding(ray, engine),
        300,
        "the engine decoding the call's responses",
        poll_s=0.02,
        give_up=lambda: "the call ended before" if ray.wait([pending], timeout=0)[0] else None,
    )


def check_pushes_reach_the_engine(ray, engine, trainer, pusher, batch: pa.Table, vocab: int, version: int) -> None:
    """`engine` holds `trainer`'s weights, pushed as `version`: its logprobs equal the trainer's; after one real update
    pushed as the next version, again (and no longer the old ones); after a push of a zeroed head, uniform."""

    def generate() -> pa.Table:
        return ray.get(engine.__call__.remote(batch))

    def gap(out: pa.Table) -> float:
        recomputed = ray.get(trainer.logprobs.remote(out["prompt_ids"].to_pylist(), out["response_ids"].to_pylist()))
        engine_lp = out["response_logprobs"].to_pylist()
        return max(abs(a - b) for e, r in zip(engine_lp, recomputed, strict=True) for a, b in zip(e, r, strict=True))

    before = generate()
    assert gap(before) < TOL  # the same weights on both sides

    # Change the trainer's weights with one real update, then push them.
    rng = np.random.default_rng(0)
    mb = {**before.to_pydict(), "advantage": rng.choice([-1.0, 1.0], before.num_rows).tolist()}
    ray.get(trainer.train_step.remote([mb]))
    stats = pusher.sync(version + 1)
    assert stats["sync/bytes"] > 0
    assert gap(before) > 10 * TOL  # the trainer moved: the old engine logprobs no longer match

    after = generate()
    assert {v for vs in after["token_param_version"].to_pylist() for v in vs} == {version + 1}
    assert gap(after) < TOL  # the engine now computes with exactly the trainer's weights

    # A deliberately destroyed head: uniform next-token distribution in the engine after the push.
    ray.get(trainer.set_weight.remote("lm_head.weight", 0.0))
    pusher.sync(version + 2)
    zeroed = generate()
    flat = [lp for lps in zeroed["response_logprobs"].to_pylist() for lp in lps]
    assert max(abs(lp + math.log(vocab)) for lp in flat) < TOL
    assert {v for vs in zeroed["token_param_version"].to_pylist() for v in vs} == {version + 2}
