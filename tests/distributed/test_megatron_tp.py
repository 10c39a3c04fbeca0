"""Tensor parallelism changes nothing but the layout: TP=2 over gloo trains with TP=1's losses.

Each layout runs as real processes on 127.0.0.1 (torch.multiprocessing, spawn), each rank a MegatronRank built
from the embedded model's HF directory. Both train the same three PPO steps on the same hand-built mini-batch.
Tolerance: 1e-5 relative on losses and grad norms, 1e-5 absolute on logprobs (the TP all-reduces sum in another
order). Weights after the steps: 1e-4 absolute, since AdamW normalises each gradient element: one whose gradient
is at rounding-noise level moves by up to lr (1e-4) per step in either layout.
"""

import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import PolicySettings

POLICY = PolicySettings(lr=1e-4, micro_batch_size=4, entropy_coeff=0.01)  # the vocab-parallel entropy in the loss

STEPS = 3
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _minibatch(seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, 291, rng.integers(3, 9)).tolist() for _ in range(6)]
    responses = [rng.integers(2, 291, rng.integers(1, 12)).tolist() for _ in range(6)]
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "advantage": rng.choice([-1.0, 1.0], 6).tolist(),
    }


def _rank(rank: int, world: int, port: int, model_dir: str, queue) -> None:
    from stages.trainer.megatron_rank import MegatronRank

    trainer = MegatronRank(model_dir, rank, world, port, tensor_model_parallel_size=world, policy=POLICY)
    mb = _minibatch()
    start = {name: t.numpy().copy() for name, t in trainer.export(bucket_bytes=64 << 10)}
    mb["response_logprobs"] = trainer.logprobs(mb["prompt_ids"], mb["response_ids"])
    steps = [trainer.train_step([mb]) for _ in range(STEPS)]
    end = {name: t.numpy().copy() for name, t in trainer.export(bucket_bytes=64 << 10)}
    if rank == 0:
        queue.put({"start": start, "end": end, "logprobs": mb["response_logprobs"], "steps": steps})


def _train(world: int, model_dir: str) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, model_dir, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    task = build_embedded(tmp_path_factory.mktemp("tp"), 10, seed=3)
    return str(task.model_dir), {world: _train(world, str(task.model_dir)) for world in (1, 2)}


def test_export_of_the_loaded_model_is_its_hf_weights(runs):
    from safetensors.torch import load_file

    model_dir, results = runs
    hf = load_file(f"{model_dir}/model.safetensors")
    for world in (1, 2):
        start = results[world]["start"]
        assert set(start) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(torch.from_numpy(start[name]), tensor), (world, name)


def test_tp2_trains_with_the_losses_of_tp1(runs):
    _, results = runs
    one, two = results[1], results[2]
    np.testing.assert_allclose(
        [x for r in one["logprobs"] for x in r], [x for r in two["logprobs"] for x in r], rtol=0, atol=TOL
    )
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "train/ratio_mean"):
        a = [s[key] for s in one["steps"]]
        b = [s[key] for s in two["steps"]]
        print(key, "TP=1", a, "TP=2", b)
        np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-7)
    assert len({s["actor/pg_loss"] for s in one["steps"]}) > 1  # the steps really changed the weights
    for name in one["end"]:
        np.testing.assert_allclose(one["end"][name], two["end"][name], rtol=0, atol=10 * TOL, err_msg=name)
        assert not np.array_equal(one["end"][name], one["start"][name]) or "norm" in name
