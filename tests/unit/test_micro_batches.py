"""Token-budget micro-batches (actor.use_dynamic_bsz, stages/trainer/micro_batches.py): every row exactly once,
within the budget, as few micro-batches as the budget allows and their tokens balanced; the same number on every
data-parallel rank; the same gradient as fixed-size micro-batches in every loss_agg_mode (the registry's modes, so a
new one is covered), across data-parallel shares too; and verl's keys, with their defaults and their errors."""

from typing import get_args

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.config.execution import reference_options, trainer_execution
from stages.trainer.balance import balanced_partitions, row_tokens, take_rows
from stages.trainer.micro_batches import MicroBatching, common_passes, token_budget
from stages.trainer.settings import LossAggMode, PolicySettings
from stages.trainer.step import Minibatch, StepTotals
from tests.unit.test_step import VOCAB, BigramForward


def _long_tail(n: int, seed: int) -> list[int]:
    """Row lengths as the seed's workload draws responses (log-normal, sigma 1, capped at 7x the mean), scaled down
    to a mean of 64, plus a 32-token prompt."""
    rng = np.random.default_rng(seed)
    response = np.minimum(448, np.exp(np.log(64) - 0.5 + rng.normal(size=n))).round().astype(int) + 1
    return (response + 32).tolist()


@pytest.mark.parametrize(
    ("n", "budget", "seed"), [(64, 1024, 0), (33, 500, 1), (8, 480, 2), (1, 480, 3), (128, 4096, 4)]
)
def test_every_row_once_within_the_budget_in_as_few_micro_batches_as_it_allows(n, budget, seed):
    lengths = _long_tail(n, seed)
    parts = token_budget(lengths, budget)
    assert sorted(i for p in parts for i in p) == list(range(n))
    assert all(p == sorted(p) for p in parts) and all(p for p in parts)
    sums = [sum(lengths[i] for i in p) for p in parts]
    assert max(sums) <= budget
    assert len(parts) <= -(-sum(lengths) // budget) + 1  # the lower bound, or one more where rows do not fit
    assert max(sums) - min(sums) <= max(lengths)  # balanced to within a row


def test_more_micro_batches_than_the_token_count_needs_when_rows_do_not_fit():
    # 180 tokens fit 2 budgets of 100 by count, but no two of the rows fit one: three micro-batches.
    assert token_budget([60, 60, 60], 100) == [[0], [1], [2]]
    assert sorted(map(len, token_budget([60, 30, 60, 30], 100))) == [2, 2]  # 90 tokens each


def test_a_row_longer_than_the_budget_is_one_clear_error():
    with pytest.raises(ValueError, match="row of 600 tokens .* raise actor.ppo_max_token_len_per_gpu to at least"):
        MicroBatching(use_dynamic_bsz=True, max_token_len=512).cut([100, 600, 30])


def test_fixed_size_micro_batches_are_runs_of_rows():
    assert MicroBatching(size=2).cut([5, 5, 5, 5, 5]) == [[0, 1], [2, 3], [4]]


def test_every_data_parallel_rank_runs_the_same_passes():
    lengths = _long_tail(64, 5)
    budget = MicroBatching(use_dynamic_bsz=True, max_token_len=700)
    for k in (2, 3, 4):
        shares = [[lengths[i] for i in part] for part in balanced_partitions(lengths, k)]
        passes = common_passes(budget, shares)
        cuts = [budget.cut(share, passes) for share in shares]
        assert all(len(cut) == passes for cut in cuts)  # every share has more rows than passes here
        assert passes == max(budget.count(share) for share in shares)
        assert all(sum(share[i] for i in p) <= 700 for share, cut in zip(shares, cuts, strict=True) for p in cut)


def _rows(seed: int = 7) -> dict[str, list]:
    """Twelve rows of very different lengths, some tokens masked, one row fully masked."""
    rng = np.random.default_rng(seed)
    lengths = (1, 14, 2, 3, 9, 1, 5, 11, 2, 4, 7, 3)
    responses = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    masks = [(rng.random(n) < 0.8).astype(int).tolist() for n in lengths]
    masks[5] = [0]
    return {
        "prompt_ids": [rng.integers(0, VOCAB, int(rng.integers(1, 4))).tolist() for _ in lengths],
        "response_ids": responses,
        "response_mask": masks,
        "response_logprobs": [(rng.normal(size=len(r)) * 0.3 - 2.0).tolist() for r in responses],
        "ref_logprobs": [(rng.normal(size=len(r)) * 0.3 - 2.0).tolist() for r in responses],
        "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
    }


def _grad(policy: PolicySettings, parts: list[list[int]]) -> tuple[torch.Tensor, dict]:
    """The ranks' shares (one part: no data parallelism) trained on one model, each cut as the policy says, every
    rank into the same number of passes; their totals merged as FSDPTrainer merges them."""
    rows, fwd = _rows(), BigramForward()
    counts = Minibatch.of(rows, policy).counts
    tokens = row_tokens(rows)
    passes = common_passes(policy.batching, [[tokens[i] for i in part] for part in parts])
    totals = []
    for part in parts:
        mb, sums = Minibatch.of(take_rows(rows, part), policy, counts=counts), StepTotals(policy)
        for index in mb.micro_batches(policy, at_least=passes):
            res = mb.loss(fwd, index, policy)
            res.total.backward()
            sums.add_micro(res)
        totals.append(sums)
    for other in totals[1:]:
        totals[0].add_rank(other)
    totals[0].add_update(0.0)
    return fwd.w.grad, totals[0].metrics()


@pytest.mark.parametrize("mode", get_args(LossAggMode))
def test_token_budget_micro_batches_give_the_fixed_ones_gradient_in_every_loss_agg_mode(mode):
    objective = dict(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, clip_ratio=0.1)
    whole, whole_metrics = _grad(PolicySettings(micro_batch_size=12, **objective), [list(range(12))])
    longest = max(row_tokens(_rows()))
    for budget in (longest, 20, 40):
        policy = PolicySettings(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget, **objective)
        assert len(Minibatch.of(_rows(), policy).micro_batches(policy)) > 1  # the budget does cut
        for parts in ([list(range(12))], balanced_partitions(row_tokens(_rows()), 3)):
            grad, metrics = _grad(policy, parts)
            assert torch.allclose(grad, whole, atol=1e-6), (mode, budget, parts)
            for key in (
                "actor/pg_loss",
                "actor/entropy",
                "actor/kl_loss",
                "actor/pg_clipfrac",
                "train/num_tokens",
            ):
                # rel too: under token-sum the loss is a sum (~17), which fp32 rounds by ~1e-6
                assert metrics[key] == pytest.approx(whole_metrics[key], rel=1e-6, abs=1e-6), (mode, key)


def test_verls_keys_and_their_defaults():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "actor_rollout_ref.model.use_remove_padding=true",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true",
            "actor_rollout_ref.actor.fsdp_config.param_offload=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
            "actor_rollout_ref.ref.fsdp_config.param_offload=true",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
        ],
    )
    run = trainer_execution(cfg)
    assert cfg.actor.policy().batching == MicroBatching(cfg.actor.micro_batch_size, True, 4096)
    assert run.use_remove_padding and run.enable_gradient_checkpointing and run.param_offload and run.optimizer_offload
    # As verl: the proximal pass's and the reference's budgets default to the actor's.
    assert (run.log_prob.use_dynamic_bsz, run.log_prob.max_token_len, run.log_prob.size) == (True, 4096, 32)
    ref = reference_options(cfg)
    assert ref == {
        "use_remove_padding": True,
        "use_dynamic_bsz": True,
        "max_token_len": 4096,
        "param_offload": True,
        "micro_batch_size": 16,
    }
    own = load_config(None, ["rollout.log_prob_use_dynamic_bsz=false", "rollout.log_prob_micro_batch_size_per_gpu=4"])
    assert (trainer_execution(own).log_prob.use_dynamic_bsz, trainer_execution(own).log_prob.size) == (False, 4)
    assert "micro_batch_size" not in reference_options(own)  # the stage's own stages.ref_logprob.micro_batch_size


def test_packing_is_on_by_default_for_the_torch_backend_and_each_backend_reads_its_own_key_as_verl():
    assert trainer_execution(load_config(None, [])).use_remove_padding  # verl's model.use_remove_padding: true
    megatron = ["trainer.backend=megatron"]
    assert not trainer_execution(load_config(None, megatron)).use_remove_padding  # no varlen attention: padded
    on = load_config(None, [*megatron, "actor_rollout_ref.actor.megatron.use_remove_padding=True"])
    assert trainer_execution(on).use_remove_padding and reference_options(on)["use_remove_padding"]
    # each backend's key leaves the other's alone
    assert trainer_execution(
        load_config(None, [*megatron, "actor.megatron.use_remove_padding=true", "model.use_remove_padding=false"])
    ).use_remove_padding
    torch_off = load_config(None, ["model.use_remove_padding=false", "actor.megatron.use_remove_padding=true"])
    assert (
        not trainer_execution(torch_off).use_remove_padding and not reference_options(torch_off)["use_remove_padding"]
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100"],
            r"actor.ppo_max_token_len_per_gpu=100 is less than the longest row.* = 112",
        ),
        (
            ["rollout.log_prob_use_dynamic_bsz=true", "rollout.log_prob_max_token_len_per_gpu=64"],
            "raise rollout.log_prob_max_token_len_per_gpu to at least 112",
        ),
        (["rollout.log_prob_micro_batch_size_per_gpu=0"], "log_prob_micro_batch_size_per_gpu must be >= 1"),
        (["actor.ppo_max_token_len_per_gpu=0"], "ppo_max_token_len_per_gpu must be >= 1"),
        (
            ["trainer.backend=megatron", "model.enable_gradient_checkpointing=true"],
            "override_transformer_config.recompute_granularity",
        ),
        (
            ["actor.megatron.override_transformer_config.recompute_granularity=selective"],
            "model.enable_gradient_checkpointing=true instead",
        ),
        (
            ["actor.megatron.override_transformer_config.recompute_granularity=full"],
            "needs recompute_method .* and recompute_num_layers >= 1",
        ),
        (["trainer.backend=megatron", "actor.fsdp_config.param_offload=true"], "the megatron backend has no offload"),
        (["actor.fsdp_config.param_offload=true", "weight_sync.backend=nccl"], "use weight_sync.backend=gloo"),
        (["actor.fsdp_config.param_offload=true", "weight_sync.backend=ipc"], "backend=ipc sends GPU tensors"),
    ],
)
def test_bad_keys_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
