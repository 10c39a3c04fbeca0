"""The Megatron trainer packed (actor.megatron.use_remove_padding: one row per micro-batch, a block-diagonal causal
mask, stages/trainer/megatron_inputs.py), with token-budget micro-batches (actor.use_dynamic_bsz) and activation
recompute (actor.megatron.override_transformer_config), trains what it trains right-padded with fixed micro-batches
and no recompute: at PP = 1, and at PP = 2 through megatron's 1F1B schedule (variable shapes: the packed rows'
lengths differ). Responses of 1 to 40 tokens, so that padding and packing differ a lot.

Real processes on 127.0.0.1 as tests/distributed/megatron_layouts.py; its tolerances: 1e-5 absolute on logprobs,
1e-5 relative on losses and grad norms, 1e-4 absolute on the weights after the steps (a packed row's positions run
on across its sequences, so RoPE's angles differ while its scores do not: rounding only).
"""

import dataclasses

import numpy as np
import pytest

from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import ExecutionSettings, PolicySettings
from tests.distributed.megatron_layouts import POLICY, STEPS, TOL, _export, train

RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
BUDGET = dataclasses.replace(POLICY, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64)


def _minibatch(seed: int = 0) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    responses = [rng.integers(2, 291, n).tolist() for n in (1, 40, 3, 25, 7, 2)]
    return {
        "prompt_ids": [rng.integers(2, 291, int(rng.integers(3, 9))).tolist() for _ in responses],
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "advantage": rng.choice([-1.0, 1.0], len(responses)).tolist(),
    }


def _rank(rank: int, tp: int, pp: int, port: int, model_dir: str, policy: PolicySettings, queue) -> None:
    """One rank, packed (with recompute) when its policy cuts by a token budget, else padded."""
    from stages.trainer.megatron_rank import MegatronRank

    packed = policy.use_dynamic_bsz
    trainer = MegatronRank(
        model_dir,
        rank,
        tp * pp,
        port,
        pipeline_model_parallel_size=pp,
        policy=policy,
        execution=ExecutionSettings(use_remove_padding=packed),
        override_transformer_config=RECOMPUTE if packed else None,
    )
    mb = _minibatch()
    logprobs = trainer.logprobs(mb["prompt_ids"], mb["response_ids"])
    last = rank == pp - 1
    mb["response_logprobs"] = logprobs if last else [[0.0] * len(r) for r in mb["response_ids"]]
    steps = [trainer.train_step([mb]) for _ in range(STEPS)]
    end = _export(trainer)
    if rank == 0:
        queue.put(("export", {"end": end}))
    if last:
        queue.put(("losses", {"logprobs": logprobs, "steps": steps}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_embedded(tmp_path_factory.mktemp("megatron_packing"), 10, seed=3).model_dir)


@pytest.fixture(scope="module")
def padded(model_dir) -> dict:
    return train(1, 1, model_dir, _rank, (POLICY,))


@pytest.mark.parametrize("pp", [1, 2])
def test_packed_with_budgets_and_recompute_trains_what_padded_trains(model_dir, padded, pp):
    packed = train(1, pp, model_dir, _rank, (BUDGET,))
    np.testing.assert_allclose(
        [x for r in padded["logprobs"] for x in r], [x for r in packed["logprobs"] for x in r], rtol=0, atol=TOL
    )
    assert len({s["actor/pg_loss"] for s in padded["steps"]}) > 1  # the steps really changed the weights
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "train/ratio_mean", "train/num_tokens"):
        a, b = [s[key] for s in padded["steps"]], [s[key] for s in packed["steps"]]
        print(key, "padded", a, f"packed PP={pp}", b)
        np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-7)
    for name in padded["end"]:
        np.testing.assert_allclose(padded["end"][name], packed["end"][name], rtol=0, atol=10 * TOL, err_msg=name)
