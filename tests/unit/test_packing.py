"""Padding-free packing (model.use_remove_padding, stages/trainer/packing.py) computes what right-padding computes,
on the embedded model's shape and a batch of very different lengths (1 to 200 response tokens):
- the torch trainer's response logprobs and entropies within 2e-5, and the gradients of a loss of both within 1e-4 of
  their largest element (fp32; the two paths sum in another order);
- a whole PPO step, with token-budget micro-batches too: the same metrics and weights after it;
- MoE routing replay: the same replayed and changed route counts, per token;
- the reference model's logprobs;
- activation checkpointing (model.enable_gradient_checkpointing): the same gradients;
- a bf16 trainer (mixed_precision.param_dtype) runs its packed forward under its autocast, as its padded one;
- a model with sliding-window layers: each attends within its window in each packed sequence.
"""

import json
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline.tasks.embedded import build_model
from stages.ref_logprob import RefLogprob
from stages.trainer import packing
from stages.trainer.packing import pack
from stages.trainer.precision import MixedPrecision
from stages.trainer.settings import ExecutionSettings, PolicySettings, RouterReplaySettings
from stages.trainer.step import pad_routes
from stages.trainer.torch_backend import TorchTrainer

VOCAB = 300
LOGP_TOL = 2e-5  # absolute, on logprobs and entropies
GRAD_TOL = 1e-4  # relative to the largest gradient element of each parameter


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("dense")
    build_model(out, VOCAB, seed=0)
    return str(out)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    build_model(out, VOCAB, seed=0, arch="moe")
    return str(out)


def _batch(seed: int = 0) -> tuple[list, list]:
    """Six (prompt, response) pairs of very different lengths: the long tail a padded micro-batch pays for."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (3, 9, 2, 6, 4, 7)]
    responses = [rng.integers(2, VOCAB, n).tolist() for n in (1, 200, 5, 60, 17, 2)]
    return prompts, responses


def _trainer(
    model_dir: str, packed: bool, checkpointing: bool = False, param_dtype: str | None = None, **policy
) -> TorchTrainer:
    execution = ExecutionSettings(use_remove_padding=packed, enable_gradient_checkpointing=checkpointing)
    precision = MixedPrecision(param_dtype=param_dtype)
    return TorchTrainer(model_dir, PolicySettings(lr=1e-3, **policy), execution=execution, mixed_precision=precision)


def _forward_and_grads(trainer: TorchTrainer, prompts: list, responses: list, **kw):
    trainer.model.zero_grad(set_to_none=True)
    fwd = trainer._token_logprobs(prompts, responses, entropy=True, **kw)
    (fwd.logp * fwd.mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return fwd, grads


def _assert_grads_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        scale = float(a[name].abs().max()) or 1.0
        assert float((a[name] - b[name]).abs().max()) <= GRAD_TOL * scale, name


def test_packed_and_padded_give_the_same_logprobs_entropy_and_gradients(dense_dir):
    prompts, responses = _batch()
    padded, g_padded = _forward_and_grads(_trainer(dense_dir, packed=False, entropy_coeff=0.01), prompts, responses)
    packed, g_packed = _forward_and_grads(_trainer(dense_dir, packed=True, entropy_coeff=0.01), prompts, responses)
    assert packed.logp.shape == padded.logp.shape == (6, 200)
    assert torch.equal(packed.mask, padded.mask)
    on = padded.mask > 0
    assert float((packed.logp - padded.logp)[on].abs().max()) < LOGP_TOL
    assert float((packed.entropy - padded.entropy)[on].abs().max()) < LOGP_TOL
    assert float(packed.logp[~on].abs().max()) == 0.0  # nothing after a response's end
    _assert_grads_close(g_padded, g_packed)


def test_a_packed_row_holds_only_the_real_tokens_with_restarting_positions():
    prompts, responses = [[5, 6], [7]], [[8, 9, 10], [11]]
    p = pack(prompts, responses)
    assert p.ids.tolist() == [[5, 6, 8, 9, 10, 7, 11]]
    assert p.positions.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert p.cu_seqlens.tolist() == [0, 5, 7]
    assert p.keep.tolist() == [1, 2, 3, 5] and p.targets.tolist() == [8, 9, 10, 11]


def test_a_packed_step_trains_what_a_padded_step_trains(dense_dir):
    prompts, responses = _batch(1)
    rng = np.random.default_rng(2)
    base = _trainer(dense_dir, packed=False, micro_batch_size=2)
    rows = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "response_logprobs": base.logprobs(prompts, responses),
        "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
    }
    budget = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))  # the longest row
    packed = _trainer(dense_dir, packed=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget)
    m_base, m_packed = base.train_step([rows]), packed.train_step([rows])
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "train/num_tokens"):
        assert m_packed[key] == pytest.approx(m_base[key], rel=1e-4, abs=1e-6), key
    # The updated models agree on the batch: AdamW's first update is lr * g / (|g| + eps) per weight, the same
    # whatever small rounding differences g has, except on weights whose gradient is near eps (seen: 1.1e-5 apart).
    after_base, after_packed = base.logprobs(prompts, responses), packed.logprobs(prompts, responses)
    moved, apart = _max_gap(rows["response_logprobs"], after_base), _max_gap(after_base, after_packed)
    assert moved > 1e-2 and apart < 1e-4, (moved, apart)


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    return float(max(np.abs(np.subtract(x, y)).max() for x, y in zip(a, b, strict=True)))


def test_packed_routing_replay_counts_the_same_routes(moe_dir):
    prompts, responses = _batch(3)
    rng = np.random.default_rng(4)
    # Random routes (4 experts, top-2, 2 layers) for every context token but the last, as the engine returns them.
    routes = [
        [rng.permutation(4)[:2].tolist() + rng.permutation(4)[:2].tolist() for _ in range(len(p) + len(r) - 1)]
        for p, r in zip(prompts, responses, strict=True)
    ]
    forced = pad_routes(prompts, responses, routes)
    replay = {"router_replay": RouterReplaySettings(mode="R3")}
    padded, g_padded = _forward_and_grads(_trainer(moe_dir, False, **replay), prompts, responses, routes=forced)
    packed, g_packed = _forward_and_grads(_trainer(moe_dir, True, **replay), prompts, responses, routes=forced)
    on = padded.mask > 0
    assert float((packed.logp - padded.logp)[on].abs().max()) < LOGP_TOL
    assert packed.routes_replayed == padded.routes_replayed == 2 * sum(len(r) for r in routes)
    assert packed.routes_changed == padded.routes_changed > 0
    for a, b in zip(packed.route_maps, padded.route_maps, strict=True):
        assert torch.equal(a, b)
    _assert_grads_close(g_padded, g_packed)


def test_the_reference_model_packed_gives_the_same_logprobs(dense_dir):
    prompts, responses = _batch(5)
    batch = pa.table({"prompt_ids": prompts, "response_ids": responses})
    padded = RefLogprob(dense_dir, micro_batch_size=2)(batch)["ref_logprobs"].to_pylist()
    packed_stage = RefLogprob(dense_dir, use_remove_padding=True, use_dynamic_bsz=True, max_token_len=250)
    packed = packed_stage(batch)["ref_logprobs"].to_pylist()
    for a, b, r in zip(padded, packed, responses, strict=True):
        assert len(a) == len(b) == len(r)
        np.testing.assert_allclose(a, b, atol=LOGP_TOL)


def test_activation_checkpointing_gives_the_same_gradients(dense_dir):
    prompts, responses = _batch(6)
    for packed in (False, True):
        plain, g_plain = _forward_and_grads(_trainer(dense_dir, packed), prompts, responses)
        ckpt, g_ckpt = _forward_and_grads(_trainer(dense_dir, packed, checkpointing=True), prompts, responses)
        assert ckpt.logp.grad_fn is not None and torch.allclose(ckpt.logp, plain.logp, atol=1e-6)
        _assert_grads_close(g_plain, g_ckpt)


def test_a_bf16_trainer_packs_under_its_autocast(dense_dir, monkeypatch):
    seen = []
    attend = packing.packed_attention

    def recording(*args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
        return attend(*args, **kwargs)

    monkeypatch.setattr(packing, "packed_attention", recording)  # registered by the trainer's use_packed_attention
    prompts, responses = _batch(7)
    padded = _trainer(dense_dir, packed=False, param_dtype="bf16")._token_logprobs(prompts, responses)
    packed = _trainer(dense_dir, packed=True, param_dtype="bf16")._token_logprobs(prompts, responses)
    assert seen and all(dtype == torch.bfloat16 for dtype in seen)
    assert packed.logp.dtype == torch.float32  # the logprobs from fp32 logits
    on = padded.mask > 0
    assert float((packed.logp - padded.logp)[on].abs().max()) < 0.05  # bf16's rounding, both paths


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory):
    """The dense model with its second layer a sliding-window layer of 8 tokens (a Qwen2 config's keys)."""
    out = tmp_path_factory.mktemp("window")
    build_model(out, VOCAB, seed=0)
    config = json.loads((out / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config |= {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    config["layer_types"] = ["full_attention"] + ["sliding_attention"] * (layers - 1)
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def test_sliding_window_layers_attend_within_their_window_when_packed(dense_dir, window_dir):
    prompts, responses = _batch(8)
    padded, g_padded = _forward_and_grads(_trainer(window_dir, packed=False), prompts, responses)
    packed, g_packed = _forward_and_grads(_trainer(window_dir, packed=True), prompts, responses)
    full = _trainer(dense_dir, packed=False)._token_logprobs(prompts, responses)
    on = padded.mask > 0
    assert float((full.logp - padded.logp)[on].abs().max()) > 1e-2  # the window changes what the model computes
    assert float((packed.logp - padded.logp)[on].abs().max()) < LOGP_TOL
    _assert_grads_close(g_padded, g_packed)


def _graph_nodes(root: torch.Tensor) -> Counter:
    """The autograd graph behind `root`: how many nodes of each kind."""
    seen, todo = set(), [root.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return Counter(type(node).__name__ for node in seen)


def test_the_packed_backward_does_not_grow_a_node_per_sequence(dense_dir):
    """Each sequence's query, key and value are pieces of one split: a slice per sequence would give each its own
    backward node, which writes its gradient into a zeroed tensor of the whole packed row (sequences x row work)."""
    trainer = _trainer(dense_dir, packed=True)
    prompts, responses = _batch()
    counts = [_graph_nodes(trainer._token_logprobs(prompts[:n], responses[:n]).logp.sum()) for n in (2, len(prompts))]
    assert counts[0]["SplitWithSizesBackward0"] == counts[1]["SplitWithSizesBackward0"] > 0
    assert counts[0]["SliceBackward0"] == counts[1]["SliceBackward0"]
