"""HF -> Megatron -> HF is exact, for the embedded model and for other GQA layouts, at every TP size that divides
the kv heads; and the fused layouts are the ones megatron-core computes with (per query group, per-rank fc1)."""

import json

import pytest
import torch

from pipeline.config import ConfigError
from pipeline.tasks.embedded import build_model
from stages.trainer.megatron_convert import ModelShape, hf_to_megatron, merge, shard, to_hf


def _random_hf(shape: ModelShape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, hd, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    out = {
        "model.embed_tokens.weight": torch.randn(shape.vocab_size, h, generator=g),
        "model.norm.weight": torch.randn(h, generator=g),
    }
    if not shape.tied_embeddings:
        out["lm_head.weight"] = torch.randn(shape.vocab_size, h, generator=g)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sizes = {
            "self_attn.q_proj.weight": (shape.num_heads * hd, h),
            "self_attn.k_proj.weight": (shape.num_kv_heads * hd, h),
            "self_attn.v_proj.weight": (shape.num_kv_heads * hd, h),
            "self_attn.o_proj.weight": (h, shape.num_heads * hd),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if shape.qkv_bias:
            sizes |= {f"self_attn.{x}_proj.bias": (sizes[f"self_attn.{x}_proj.weight"][0],) for x in "qkv"}
        out |= {p + k: torch.randn(*v, generator=g) for k, v in sizes.items()}
    return out


def _round_trip(hf: dict[str, torch.Tensor], shape: ModelShape, tp: int) -> dict[str, torch.Tensor]:
    full = hf_to_megatron(hf, shape)
    back: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        shards = [shard(name, tensor, r, tp, shape) for r in range(tp)]
        back |= dict(to_hf(name, merge(name, shards, shape), shape))
    return back


def _shape(**kw) -> ModelShape:
    base = dict(num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=8, ffn_hidden_size=96,
                vocab_size=101, qkv_bias=True, tied_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                max_positions=128)  # fmt: skip
    return ModelShape(**(base | kw))


def test_embedded_model_round_trips_exactly(tmp_path):
    from safetensors.torch import load_file

    build_model(tmp_path, vocab_size=291, seed=0)
    shape = ModelShape.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (shape.num_heads, shape.num_kv_heads, shape.qkv_bias, shape.tied_embeddings) == (4, 2, True, False)
    hf = load_file(tmp_path / "model.safetensors")
    for tp in (1, 2):
        back = _round_trip(hf, shape, tp)
        assert set(back) == set(hf)
        assert all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize(
    ("kw", "tp"),
    [
        ({}, 1),
        ({}, 2),
        ({"num_kv_heads": 1}, 1),  # multi-query
        ({"num_kv_heads": 8}, 2),  # plain multi-head
        ({"num_kv_heads": 8}, 4),
        ({"tied_embeddings": True, "qkv_bias": False}, 2),  # Llama-style, tied head
    ],
)
def test_gqa_layouts_round_trip_exactly(kw, tp):
    shape = _shape(**kw)
    hf = _random_hf(shape)
    back = _round_trip(hf, shape, tp)
    expected = hf | ({"lm_head.weight": hf["model.embed_tokens.weight"]} if shape.tied_embeddings else {})
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)


def test_qkv_is_laid_out_per_query_group():
    shape = _shape(num_layers=1)
    hf = _random_hf(shape)
    qkv = hf_to_megatron(hf, shape)["decoder.layers.0.self_attention.linear_qkv.weight"]
    heads_per_group = shape.num_heads // shape.num_kv_heads  # 4
    hd = shape.head_dim
    group1 = qkv.view(shape.num_kv_heads, (heads_per_group + 2) * hd, -1)[1]  # the second kv group
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(group1[: heads_per_group * hd], q[heads_per_group * hd : 2 * heads_per_group * hd])
    assert torch.equal(group1[-2 * hd : -hd], hf["model.layers.0.self_attn.k_proj.weight"][hd : 2 * hd])
    assert torch.equal(group1[-hd:], hf["model.layers.0.self_attn.v_proj.weight"][hd : 2 * hd])


def test_fc1_shard_holds_its_own_gate_and_up_rows():
    shape = _shape(num_layers=1)
    hf = _random_hf(shape)
    fc1 = hf_to_megatron(hf, shape)["decoder.layers.0.mlp.linear_fc1.weight"]
    rank1 = shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2, shape)
    half = shape.ffn_hidden_size // 2
    assert torch.equal(rank1[:half], hf["model.layers.0.mlp.gate_proj.weight"][half:])
    assert torch.equal(rank1[half:], hf["model.layers.0.mlp.up_proj.weight"][half:])


def test_vocab_is_padded_to_a_multiple_of_tp():
    shape = _shape(vocab_size=101)
    emb = torch.randn(101, 64)
    shards = [shard("embedding.word_embeddings.weight", emb, r, 2, shape) for r in range(2)]
    assert [s.shape[0] for s in shards] == [51, 51]
    assert torch.equal(shards[1][-1], torch.zeros(64))
    assert torch.equal(merge("embedding.word_embeddings.weight", shards, shape), emb)


def test_tp_that_does_not_split_the_heads_is_one_clear_error():
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 must divide"):
        _shape().check_tp(3)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        ModelShape.from_hf({"model_type": "gpt2"})
    scaled = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="builds plain RoPE"):
        ModelShape.from_hf(scaled)


def test_prepare_refuses_a_tp_the_model_cannot_take(tmp_path):
    from pipeline.config import load_config
    from pipeline.prepare import check_megatron

    build_model(tmp_path, vocab_size=291, seed=0)
    cfg = load_config(None, ["trainer.backend=megatron", "actor.megatron.tensor_model_parallel_size=4"])
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(2\)"):
        check_megatron(cfg, tmp_path)


def test_prepare_refuses_a_pp_that_does_not_split_the_layers(tmp_path):
    from pipeline.config import load_config
    from pipeline.prepare import check_megatron

    build_model(tmp_path, vocab_size=291, seed=0)  # 2 layers
    check_megatron(
        load_config(None, ["trainer.backend=megatron", "actor.megatron.pipeline_model_parallel_size=2"]), tmp_path
    )
    cfg = load_config(None, ["trainer.backend=megatron", "actor.megatron.pipeline_model_parallel_size=3"])
    with pytest.raises(ConfigError, match=r"pipeline_model_parallel_size=3 must divide num_hidden_layers \(2\)"):
        check_megatron(cfg, tmp_path)
    moe = _shape(num_experts=4, moe_ffn_hidden_size=32, moe_topk=2, moe_layers=(0, 1))
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=2 with a MoE model is not supported"):
        moe.check_pp(2)


def test_a_pipeline_stage_names_its_layers_by_their_global_index():
    from stages.trainer.megatron_pipeline import Stage

    first, last = Stage(0, 2, 4, tied_embeddings=True), Stage(1, 2, 4, tied_embeddings=True)
    assert first.global_name("decoder.layers.1.mlp.linear_fc2.weight") == "decoder.layers.1.mlp.linear_fc2.weight"
    assert last.global_name("decoder.layers.1.mlp.linear_fc2.weight") == "decoder.layers.3.mlp.linear_fc2.weight"
    assert last.is_tied_copy("output_layer.weight") and not first.is_tied_copy("output_layer.weight")
    assert last.global_name("output_layer.weight") == "embedding.word_embeddings.weight"
    assert not Stage(1, 2, 4, tied_embeddings=False).is_tied_copy("output_layer.weight")
    holds = {name: (first.holds(name), last.holds(name)) for name in (
        "embedding.word_embeddings.weight", "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.2.input_layernorm.weight", "decoder.final_layernorm.weight", "output_layer.weight",
    )}  # fmt: skip
    assert list(holds.values()) == [(True, False), (True, False), (False, True), (False, True), (False, True)]


@pytest.mark.parametrize(
    ("overrides", "moe_layers"),
    [({}, (0, 1)), ({"mlp_only_layers": [0]}, (1,)), ({"decoder_sparse_step": 2}, (1,))],
    ids=["all_moe", "mlp_only_layers", "sparse_step"],
)
def test_qwen3_moe_round_trips_exactly(tmp_path, overrides, moe_layers):
    """Experts, routers and q/k norms, also beside dense layers; the export names are the checkpoint's own."""
    from safetensors.torch import load_file

    from tests.moe_model import build_tiny_moe

    build_tiny_moe(tmp_path, **overrides)
    shape = ModelShape.from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert (shape.num_experts, shape.moe_topk, shape.moe_ffn_hidden_size) == (4, 2, 32)
    assert (shape.moe_layers, shape.qk_layernorm, shape.norm_topk_prob, shape.qkv_bias) == (
        moe_layers,
        True,
        True,
        False,
    )
    hf = load_file(tmp_path / "model.safetensors")
    full = hf_to_megatron(hf, shape)
    layer = f"decoder.layers.{moe_layers[0]}."
    assert torch.equal(full[layer + "mlp.router.weight"], hf[f"model.layers.{moe_layers[0]}.mlp.gate.weight"])
    fc1 = full[layer + "mlp.experts.local_experts.3.linear_fc1.weight"]  # [gate; up] of expert 3
    assert torch.equal(fc1[32:], hf[f"model.layers.{moe_layers[0]}.mlp.experts.3.up_proj.weight"])
    back = _round_trip(hf, shape, tp=1)
    assert set(back) == set(hf)
    assert all(torch.equal(back[k], hf[k]) for k in hf)


def test_moe_routers_and_qk_norms_are_replicated_and_tp_is_refused():
    from stages.trainer.megatron_convert import shard_dim

    assert shard_dim("decoder.layers.0.mlp.router.weight") is None
    assert shard_dim("decoder.layers.0.self_attention.q_layernorm.weight") is None
    assert shard_dim("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight") == 1
    moe = _shape(num_experts=4, moe_ffn_hidden_size=32, moe_topk=2, moe_layers=(0, 1))
    moe.check_tp(1)
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 with a MoE model needs sequence parallelism"):
        moe.check_tp(2)
