"""Megatron ranks as real processes on 127.0.0.1 (torch.multiprocessing, spawn), each a MegatronRank built from the
embedded model's HF directory, training three PPO steps on one hand-built mini-batch: the runs that
test_megatron_tp.py and test_megatron_pp.py compare, each layout trained once per session (conftest.py) so that the
one-rank baseline both compare against is not trained twice.

A layout is (kind, TP, PP): `untied` is the embedded model as built, `tied` the same weights with
`tie_word_embeddings` and no lm_head. A run gives the export before and after the steps (rank 0), the HF metadata,
and the logprobs and step metrics of the last stage.
"""

from __future__ import annotations

import json
import socket
import traceback
from pathlib import Path

import numpy as np
import torch.multiprocessing as mp

from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import PolicySettings

POLICY = PolicySettings(lr=1e-4, micro_batch_size=4, entropy_coeff=0.01)  # the vocab-parallel entropy in the loss
STEPS = 3
TOL = 1e-5


def minibatch(seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 291, rng.integers(3, 9)).tolist() for _ in range(6)]
    responses = [rng.integers(2, 291, rng.integers(1, 12)).tolist() for _ in range(6)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "advantage": rng.choice([-1.0, 1.0], 6).tolist(),
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _export(trainer) -> dict[str, np.ndarray]:
    return {name: t.numpy().copy() for name, t in trainer.export(bucket_bytes=64 << 10)}


def _rank(rank: int, tp: int, pp: int, port: int, model_dir: str, queue) -> None:
    from stages.trainer.megatron_rank import MegatronRank

    world = tp * pp
    trainer = MegatronRank(
        model_dir, rank, world, port, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, policy=POLICY
    )
    mb = minibatch()
    start, meta = _export(trainer), trainer.hf_meta()
    logprobs = trainer.logprobs(mb["prompt_ids"], mb["response_ids"])
    with_pi2 = trainer.logprobs(mb["prompt_ids"], mb["response_ids"], sum_pi2=True)  # the optimal token baseline's
    last = rank >= tp * (pp - 1)  # the last stage's ranks: the other stages have no logprobs and compute no loss
    mb["response_logprobs"] = logprobs if last else [[0.0] * len(r) for r in mb["response_ids"]]
    steps = [trainer.train_step([mb]) for _ in range(STEPS)]
    end = _export(trainer)
    if rank == 0:
        queue.put(("export", {"start": start, "end": end, "meta": meta}))
    if rank == tp * (pp - 1):
        assert [row for row, _ in with_pi2] == logprobs
        queue.put(("losses", {"logprobs": logprobs, "sum_pi2": [spi for _, spi in with_pi2], "steps": steps}))


PORT_TRIES = 3


def train(tp: int, pp: int, model_dir: str, target=None, extra: tuple = ()) -> dict:
    """One layout's run: its ranks as processes running `target` (default `_rank`, called with
    (rank, tp, pp, port, model_dir, *extra, queue)), their results once all have ended well. A rank that fails sends
    its traceback, which fails the run at once (not after the results' timeout); when another process took the free
    port before rank 0 bound it ("Address already in use"), the ranks start again on another, up to PORT_TRIES times."""
    for attempt in range(1, PORT_TRIES + 1):
        result, error = _run_ranks(tp, pp, model_dir, target or _rank, extra)
        if error is None:
            return result["export"] | result["losses"]
        if "Address already in use" not in error or attempt == PORT_TRIES:
            raise AssertionError(f"a rank of TP={tp} x PP={pp} failed (try {attempt}):\n{error}")
        print(f"megatron_layouts: the rendezvous port was taken (try {attempt}), starting the ranks again")
    raise AssertionError("unreachable")


def _run_ranks(tp: int, pp: int, model_dir: str, target, extra: tuple) -> tuple[dict, str | None]:
    """(results by kind, None), or ({}, the first failing rank's traceback) with every rank ended."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    args = [(target, r, tp, pp, port, model_dir, *extra, queue) for r in range(tp * pp)]
    procs = [ctx.Process(target=_guarded, args=a) for a in args]
    for p in procs:
        p.start()
    results: dict = {}
    while len(results) < 2:
        kind, value = queue.get(timeout=300)
        if kind == "error":
            for p in procs:
                p.kill()
                p.join(timeout=60)
            return {}, value
        results[kind] = value
    for rank, p in enumerate(procs):
        p.join(timeout=60)
        assert p.exitcode == 0, f"rank {rank} of TP={tp} x PP={pp} sent its results, then exited with {p.exitcode}"
    return results, None


def _guarded(target, *args) -> None:
    """`target(*args)` in a rank's process; its traceback goes to the parent (the queue is the last argument). The
    ranks then leave their process group together, so that none exits while a peer still talks to it (a rank once
    ended with a non-zero exit code after sending its results)."""
    import torch.distributed as dist

    try:
        target(*args)
    except BaseException:
        args[-1].put(("error", traceback.format_exc()))
        raise
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def tie(model_dir: Path, out: Path) -> str:
    """The same model with a tied embedding: config.json says so and the safetensors lose lm_head."""
    from safetensors.torch import load_file, save_file

    out.mkdir()
    config = json.loads((model_dir / "config.json").read_text()) | {"tie_word_embeddings": True}
    (out / "config.json").write_text(json.dumps(config))
    weights = load_file(model_dir / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, out / "model.safetensors")
    return str(out)


class Layouts:
    """The embedded model (seed 3) untied and tied, and each layout's run, trained the first time it is asked for."""

    def __init__(self, root: Path) -> None:
        untied = build_embedded(root, 10, seed=3).model_dir
        self.model_dirs = {"untied": str(untied), "tied": tie(untied, root / "tied")}
        self._runs: dict[tuple[str, int, int], dict] = {}

    def run(self, kind: str, tp: int, pp: int) -> dict:
        if (kind, tp, pp) not in self._runs:
            self._runs[(kind, tp, pp)] = train(tp, pp, self.model_dirs[kind])
        return self._runs[(kind, tp, pp)]
