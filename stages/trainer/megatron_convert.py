"""HF <-> Megatron-core weight layout for the Llama/Qwen2 family and Qwen3-MoE (megatron-core's local layer spec).

Pure tensor code, no megatron import, so it is unit-tested on its own. The two layouts differ in four ways:

- `linear_qkv` fuses q, k and v **per query group**: for each of the `ng` kv heads, its `nh/ng` query heads, then
  its k head, then its v head: `view(ng, nh/ng + 2, hd, H)`. Column-parallel TP shards split whole groups, so the
  TP shards concatenated along dim 0 are again the full per-group layout.
- `linear_fc1` fuses gate and up as `[gate; up]`, but **per TP rank**: rank r holds `[gate_r; up_r]`, so a plain
  concatenation of shards would interleave them; gathering and sharding go through `fc1_shards`/`fc1_merge`.
- The vocabulary is padded to a multiple of TP (each rank holds `vocab_padded / tp` rows of the embedding and
  the output layer); the padded rows are dropped on export and never win a softmax (the trainer masks them).
- Names: `embedding.word_embeddings -> model.embed_tokens`, `output_layer -> lm_head`, `decoder.final_layernorm
  -> model.norm`, `pre_mlp_layernorm -> post_attention_layernorm`, `linear_proj -> o_proj`, `linear_fc2 ->
  down_proj`.

Qwen3-MoE adds per-head q/k RMSNorms (`q_norm -> self_attention.q_layernorm`, `k_norm -> k_layernorm`) and, on its
MoE layers, a router (`mlp.gate -> mlp.router`) and experts kept one module per expert on both sides
(`mlp.experts.{e}.{gate,up,down}_proj` <-> `mlp.experts.local_experts.{e}.linear_fc1/linear_fc2`, fc1 fused as above).
The export keeps HF's checkpoint names (one tensor per expert), which both vLLM and transformers load; a
transformers model in memory fuses them (`experts.gate_up_proj`), but only on load.

A Megatron parameter is TP-sharded along `shard_dim(name)` (0: column-parallel and vocab-parallel, 1:
row-parallel, None: replicated norms and routers).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Megatron name inside a layer -> HF name inside `model.layers.{i}.` (qkv and fc1 are fused: handled apart).
_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
}
_QK_NORMS = {"self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
             "self_attention.k_layernorm.weight": "self_attn.k_norm.weight"}  # fmt: skip
_ROUTER = ("mlp.router.weight", "mlp.gate.weight")
# An MLP's fc1/fc2 inside a layer: the dense one, or expert e's (Megatron `experts.local_experts.e`, HF `experts.e`).
_MLP = re.compile(r"^mlp\.(?:experts\.local_experts\.(\d+)\.)?(linear_fc1|linear_fc2)\.weight$")
_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_REPLICATED = ("layernorm.weight", _ROUTER[0])
MODEL_TYPES = ("qwen2", "llama", "qwen3_moe")


@dataclass(frozen=True)
class ModelShape:
    """What the layout conversion needs from an HF config.json (Llama/Qwen2 family, Qwen3-MoE)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    qkv_bias: bool
    tied_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    qk_layernorm: bool = False
    num_experts: int = 0  # 0: a dense model
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    moe_topk: int = 0  # experts per token
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    moe_layers: tuple[int, ...] = ()  # the layers whose MLP is a MoE block, in order

    @classmethod
    def from_hf(cls, config: Mapping) -> ModelShape:
        kind = config.get("model_type")
        if kind not in MODEL_TYPES:
            raise ValueError(
                f"trainer.backend=megatron converts {', '.join(MODEL_TYPES)} models; config.json has model_type="
                f"{kind!r}. Use trainer.backend=torch for other architectures."
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"trainer.backend=megatron expects hidden_act=silu (SwiGLU), not {config['hidden_act']}")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default" or scaling.get("rope_type", scaling.get("type")):
            raise ValueError(
                "trainer.backend=megatron builds plain RoPE; this model scales it "
                f"({rope or scaling}): use trainer.backend=torch"
            )
        heads = config["num_attention_heads"]
        return cls(
            num_layers=config["num_hidden_layers"],
            hidden_size=config["hidden_size"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            qkv_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            max_positions=config.get("max_position_embeddings", 4096),
            **(_moe_fields(config) if kind == "qwen3_moe" else {}),
        )

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab_size // tp) * tp

    def check_tp(self, tp: int) -> None:
        """TP must split whole query groups: one clear error naming the model's numbers."""
        if tp < 1 or self.num_kv_heads % tp or self.num_heads % tp:
            raise ValueError(
                f"megatron.tensor_model_parallel_size={tp} must divide num_attention_heads ({self.num_heads}) and "
                f"num_key_value_heads ({self.num_kv_heads}) of the model; pick a divisor of {self.num_kv_heads}."
            )
        if tp > 1 and self.is_moe:  # megatron-core refuses to train MoE under TP without sequence parallelism
            raise ValueError(
                f"megatron.tensor_model_parallel_size={tp} with a MoE model needs sequence parallelism, which this "
                "trainer does not set up: use tensor_model_parallel_size=1 (or trainer.backend=torch)"
            )

    def check_pp(self, pp: int) -> None:
        """Each pipeline stage holds the same number of whole layers; MoE models stay on one stage."""
        if pp < 1 or self.num_layers % pp:
            raise ValueError(
                f"megatron.pipeline_model_parallel_size={pp} must divide num_hidden_layers ({self.num_layers}) of "
                f"the model; pick a divisor of {self.num_layers}."
            )
        if pp > 1 and self.is_moe:  # the dispatcher that runs without CUDA streams refuses variable lengths
            raise ValueError(
                f"megatron.pipeline_model_parallel_size={pp} with a MoE model is not supported: megatron-core's "
                "allgather token dispatcher refuses the variable sequence lengths the stages exchange; use "
                "pipeline_model_parallel_size=1"
            )


def _moe_fields(config: Mapping) -> dict:
    """Qwen3-MoE: q/k norms, and a MoE block on every `decoder_sparse_step`-th layer not in `mlp_only_layers`."""
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    step, dense = config.get("decoder_sparse_step", 1), set(config.get("mlp_only_layers") or ())
    layers = [i for i in range(config["num_hidden_layers"]) if experts and (i + 1) % step == 0 and i not in dense]
    return dict(
        qk_layernorm=True,
        num_experts=experts,
        moe_ffn_hidden_size=config["moe_intermediate_size"],
        moe_topk=config["num_experts_per_tok"],
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        moe_layers=tuple(layers),
    )


def shard_dim(name: str) -> int | None:
    """The dim a Megatron parameter is TP-sharded along, None when every rank holds all of it."""
    if name.endswith(_REPLICATED):
        return None
    return 1 if name.endswith(_ROW_PARALLEL) else 0


# --- HF -> Megatron ----------------------------------------------------------------------------------------------
def _qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """Fuse q (nh*hd, ...), k and v (ng*hd, ...) into the per-query-group layout (ng*(nh/ng+2)*hd, ...)."""
    ng, hd = shape.num_kv_heads, shape.head_dim
    rest = q.shape[1:]
    parts = [q.reshape(ng, -1, hd, *rest), k.reshape(ng, 1, hd, *rest), v.reshape(ng, 1, hd, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ng, nh, hd = shape.num_kv_heads, shape.num_heads, shape.head_dim
    rest = qkv.shape[1:]
    grouped = qkv.reshape(ng, nh // ng + 2, hd, *rest)
    q, k, v = torch.split(grouped, [nh // ng, 1, 1], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _mlp_prefixes(shape: ModelShape, layer: int) -> list[tuple[str, str]]:
    """(Megatron, HF) name prefixes of a layer's MLPs: the dense one, or each expert of a MoE layer."""
    if layer not in shape.moe_layers:
        return [("mlp.", "mlp.")]
    return [(f"mlp.experts.local_experts.{e}.", f"mlp.experts.{e}.") for e in range(shape.num_experts)]


def hf_to_megatron(hf: Mapping[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """The full (unsharded) Megatron state dict of an HF state dict; shard it with `shard`."""
    out: dict[str, torch.Tensor] = {}
    out["embedding.word_embeddings.weight"] = hf["model.embed_tokens.weight"]
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        plain = _PLAIN | (_QK_NORMS if shape.qk_layernorm else {}) | (dict([_ROUTER]) if i in shape.moe_layers else {})
        for mg, name in plain.items():
            out[dst + mg] = hf[src + name]
        att = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = _qkv(
            hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"], shape
        )
        if shape.qkv_bias:
            out[dst + "self_attention.linear_qkv.bias"] = _qkv(
                hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"], shape
            )
        for mg, name in _mlp_prefixes(shape, i):
            out[dst + mg + "linear_fc1.weight"] = torch.cat(
                [hf[src + name + "gate_proj.weight"], hf[src + name + "up_proj.weight"]]
            )
            out[dst + mg + "linear_fc2.weight"] = hf[src + name + "down_proj.weight"]
    return out


def shard(name: str, full: torch.Tensor, rank: int, tp: int, shape: ModelShape) -> torch.Tensor:
    """TP rank `rank`'s slice of one full Megatron tensor (vocab rows padded with zeros to a multiple of tp)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        padded = full.new_zeros(shape.padded_vocab(tp), full.shape[1])
        padded[: full.shape[0]] = full
        full = padded
    dim = shard_dim(name)
    if dim is None or tp == 1:
        return full.clone()
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]]).clone()
    return full.chunk(tp, dim=dim)[rank].clone()


# --- Megatron -> HF ----------------------------------------------------------------------------------------------
def merge(name: str, shards: list[torch.Tensor], shape: ModelShape) -> torch.Tensor:
    """One full Megatron tensor from its TP shards (in rank order), vocab padding dropped."""
    dim = shard_dim(name)
    if dim is None or len(shards) == 1:
        full = shards[0]
    elif name.endswith("linear_fc1.weight"):
        halves = [s.chunk(2) for s in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(shards, dim=dim)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        full = full[: shape.vocab_size]
    return full


def to_hf(name: str, full: torch.Tensor, shape: ModelShape) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of one full Megatron tensor: fused tensors give two or three."""
    if name == "embedding.word_embeddings.weight":
        yield "model.embed_tokens.weight", full
        if shape.tied_embeddings:  # vLLM keeps its own head: send it, or it stays stale
            yield "lm_head.weight", full
        return
    if name == "output_layer.weight":
        yield "lm_head.weight", full
        return
    if name == "decoder.final_layernorm.weight":
        yield "model.norm.weight", full
        return
    match = _LAYER.match(name)
    if match is None:
        raise KeyError(f"no HF name for Megatron parameter {name}")
    layer, rest = match.groups()
    prefix = f"model.layers.{layer}."
    plain = _PLAIN | _QK_NORMS | dict([_ROUTER])
    mlp = _MLP.match(rest)
    if rest in plain:
        yield prefix + plain[rest], full
    elif rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]  # weight or bias
        for proj, part in zip("qkv", _split_qkv(full, shape), strict=True):
            yield f"{prefix}self_attn.{proj}_proj.{kind}", part.contiguous()
    elif mlp is not None:
        expert, which = mlp.groups()
        hf_mlp = prefix + ("mlp." if expert is None else f"mlp.experts.{expert}.")
        if which == "linear_fc2":
            yield hf_mlp + "down_proj.weight", full
            return
        gate, up = full.chunk(2)
        yield hf_mlp + "gate_proj.weight", gate.contiguous()
        yield hf_mlp + "up_proj.weight", up.contiguous()
    else:
        raise KeyError(f"no HF name for Megatron parameter {name}")


def load_hf(model_dir: Path) -> dict[str, torch.Tensor]:
    """A Hugging Face checkpoint's tensors (every *.safetensors file in model_dir), as float32."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    if not state:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights for trainer.backend=megatron")
    return {k: v.float() for k, v in state.items()}
