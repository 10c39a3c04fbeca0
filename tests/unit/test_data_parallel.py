"""The torch trainer's data parallelism without processes: the token-balanced split of a mini-batch (every row
exactly once, row counts within one, token sums close), the arithmetic that makes DP = 2 train what DP = 1 trains
(each rank's share divided by the WHOLE mini-batch's counts, the shares' gradients and sums added up), and the
`actor.fsdp_config.fsdp_size` key. tests/distributed/test_fsdp_dp.py runs the real FSDP2 ranks."""

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from stages.trainer.balance import balanced_partitions, take_rows
from stages.trainer.settings import PolicySettings
from stages.trainer.step import Minibatch, StepTotals
from tests.unit.test_step import BigramForward, _rows

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize(("rows", "k"), [(10, 2), (7, 2), (33, 4), (64, 8), (3, 4), (1, 2), (0, 3)])
def test_every_row_lands_in_exactly_one_part_and_the_row_counts_differ_by_at_most_one(rows, k):
    tokens = np.random.default_rng(rows).integers(5, 3000, rows).tolist()
    parts = balanced_partitions(tokens, k)
    assert len(parts) == k
    assert sorted(i for part in parts for i in part) == list(range(rows))
    assert all(part == sorted(part) for part in parts)  # the mini-batch's order within a rank
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == rows


def test_the_token_sums_are_balanced():
    rng = np.random.default_rng(0)
    tokens = rng.integers(20, 2000, 64).tolist()
    sums = sorted(sum(tokens[i] for i in part) for part in balanced_partitions(tokens, 4))
    # Karmarkar-Karp gets within a row length of even; a naive split of the sorted rows is far off
    assert sums[-1] - sums[0] < max(tokens)
    naive = [sum(sorted(tokens)[i::4]) for i in range(4)]
    assert sums[-1] - sums[0] < max(naive) - min(naive)
    # the two long rows go to different ranks
    assert all(len({0, 1} & set(part)) == 1 for part in balanced_partitions([1000, 1000, 1, 1], 2))


def test_take_rows_keeps_every_column():
    rows = {"a": [10, 11, 12], "b": ["x", "y", "z"]}
    assert take_rows(rows, [2, 0]) == {"a": [12, 10], "b": ["z", "x"]}


def _shared(policy: PolicySettings, parts: list[list[int]], micro: int) -> tuple[torch.Tensor, StepTotals]:
    """The ranks' shares run on one model (their gradients add, as FSDP's summed reduction adds them), each
    divided by the whole mini-batch's counts; their totals merged as FSDPTrainer merges them."""
    rows, fwd = _rows(), BigramForward()
    counts = Minibatch.of(rows, policy).counts
    ranks = []
    for index in parts:
        totals = StepTotals(policy)
        mb = Minibatch.of(take_rows(rows, index), policy, counts=counts)
        for sl in mb.slices(micro):
            res = mb.loss(fwd, sl, policy)
            res.total.backward()
            totals.add_micro(res)
        totals.add_update(1.5)  # the whole model's norm: the same on every rank
        ranks.append(totals)
    for other in ranks[1:]:
        ranks[0].add_rank(other)
    return fwd.w.grad, ranks[0]


@pytest.mark.parametrize("mode", MODES)
def test_shares_divided_by_the_whole_mini_batch_add_up_to_it(mode):
    policy = PolicySettings(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, clip_ratio=0.1)
    whole, one = _shared(policy, [[0, 1, 2, 3, 4]], micro=5)
    tokens = [len(p) + len(r) for p, r in zip(_rows()["prompt_ids"], _rows()["response_ids"], strict=True)]
    for parts in (balanced_partitions(tokens, 2), balanced_partitions(tokens, 3), [[0, 1, 2, 3, 4], []]):
        grad, two = _shared(policy, parts, micro=2)
        assert torch.allclose(grad, whole, atol=1e-6), (mode, parts)
        m1, m2 = one.metrics(), two.metrics()
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert m2[key] == pytest.approx(m1[key], abs=1e-6), (mode, key)
        assert m2["actor/grad_norm"] == 1.5 and m2["train/num_tokens"] == m1["train/num_tokens"] == 9.0


def test_fsdp_size_key():
    assert load_config(None).actor.fsdp_config.fsdp_size == 1
    verl = load_config(None, ["actor_rollout_ref.actor.fsdp_config.fsdp_size=2"])
    assert verl.actor.fsdp_config.fsdp_size == 2
    with pytest.raises(ConfigError, match="Did you mean 'fsdp_size'"):
        load_config(None, ["actor.fsdp_config.fsdp_szie=2"])


def test_trainer_ranks_come_from_verls_keys():
    """verl sizes the trainer by its GPUs: Megatron's DP is the ranks over TP x PP, and fsdp_size -1 is all."""
    from pipeline.config.placement import megatron_data_parallel_size, trainer_ranks

    megatron = ["trainer.backend=megatron", "actor.megatron.tensor_model_parallel_size=2"]
    one_replica = load_config(None, megatron)
    assert (trainer_ranks(one_replica), megatron_data_parallel_size(one_replica)) == (2, 1)
    grid = load_config(None, [*megatron, "trainer.n_gpus_per_node=6"])
    assert (trainer_ranks(grid), megatron_data_parallel_size(grid)) == (6, 3)
    fsdp = load_config(None, ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"])
    assert fsdp.actor.fsdp_config.fsdp_size == trainer_ranks(fsdp) == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.fsdp_config.fsdp_size=0"], "fsdp_size must be >= 1 .*not 0"),
        (["actor.fsdp_config.fsdp_size=-1"], "or -1 with trainer.n_gpus_per_node"),
        (["trainer.backend=megatron", "actor.fsdp_config.fsdp_size=2"], "set trainer.backend=torch or"),
        (["trainer.n_gpus_per_node=4", "actor.fsdp_config.fsdp_size=2"], r"fsdp_size=-1 \(all of them\)"),
        (["trainer.n_gpus_per_node=-2"], "n_gpus_per_node must be >= 0"),
        (["trainer.nnodes=0"], "nnodes must be >= 1"),
        (["trainer.nnodes=2", "actor.fsdp_config.fsdp_size=2"], "set trainer.n_gpus_per_node"),
        (
            [
                "trainer.backend=megatron",
                "actor.megatron.tensor_model_parallel_size=2",
                "trainer.n_gpus_per_node=1",
                "trainer.nnodes=2",
            ],
            "tensor-parallel group would span two",
        ),
        (
            ["trainer.backend=megatron", "actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=3"],
            "3 trainer ranks is not a multiple of .* = 2",
        ),
    ],
)
def test_bad_fsdp_sizes_are_one_clear_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_a_tied_head_follows_its_embedding_and_is_published_as_a_copy(tmp_path):
    """The export gathers each parameter once: a tied head must come right after the embedding it reuses."""
    from safetensors.numpy import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stages.trainer.torch_backend import TorchTrainer

    shape = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=40, tie_word_embeddings=True, **shape)).save_pretrained(tmp_path / "m")
    trainer = TorchTrainer(str(tmp_path / "m"))
    names = trainer.weight_meta().names
    assert names[names.index("model.embed_tokens.weight") + 1] == "lm_head.weight"
    trainer.publish_weights(str(tmp_path / "w.safetensors"))  # safetensors refuses two names on one storage
    weights = load_file(tmp_path / "w.safetensors")
    assert list(weights) != [] and (weights["lm_head.weight"] == weights["model.embed_tokens.weight"]).all()
