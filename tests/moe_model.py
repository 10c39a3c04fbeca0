"""A tiny random Qwen3-MoE for the routing-replay tests, and its routes as an engine would capture them.

2 layers, hidden 64, 4 experts of 32, top-2, vocabulary 97: built with transformers' own config class and saved
with save_pretrained, so the files are what an HF checkpoint of that architecture holds (one tensor per expert).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def build_tiny_moe(path: Path, norm_topk_prob: bool = True, seed: int = 0, **overrides) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**(SIZES | {"norm_topk_prob": norm_topk_prob} | overrides))
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # a wider router init than transformers' 0.02: tokens disagree on their experts
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def batch(seed: int = 0, n: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and responses of different lengths, so a micro-batch pads."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, SIZES["vocab_size"], int(rng.integers(2, 7))).tolist() for _ in range(n)]
    responses = [rng.integers(0, SIZES["vocab_size"], int(rng.integers(1, 8))).tolist() for _ in range(n)]
    return prompts, responses


@torch.no_grad()
def own_routes(model_dir: Path, prompts: list, responses: list, device: str = "cpu") -> list[list[list[int]]]:
    """Each sequence's routes under the model's own routers (fp32, on `device`), one sequence at a time (an engine's
    view): per context token but the last, every MoE layer's top-k ids, layer after layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    routers = [m for m in model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: seen.append(out[2])) for r in routers]
    rows = []
    for p, r in zip(prompts, responses, strict=True):
        seen.clear()
        model(input_ids=torch.tensor([p + r], device=device))
        rows.append(torch.cat(seen, dim=-1)[:-1].tolist())  # (S - 1, layers * k)
    for h in hooks:
        h.remove()
    return rows


def minibatch(prompts: list, responses: list, routes: list | None, logprobs: list | None = None) -> dict[str, list]:
    """A mini-batch of `batch()`'s rows as the trainer takes it, with these routes (advantages 1, -1, 0.5)."""
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_mask": [[1] * len(r) for r in responses],
        "response_logprobs": logprobs or [[-1.0] * len(r) for r in responses],
        "advantage": [1.0, -1.0, 0.5][: len(responses)],
        "routed_experts": routes,
    }


def other_routes(rows: list, num_experts: int = SIZES["num_experts"]) -> list:
    """Every expert id shifted by one: with 4 experts and top-2, never the same set as before."""
    return [[[(e + 1) % num_experts for e in token] for token in row] for row in rows]
