"""The random models and the fixed batch every piece of the GPU check trains on.

Three sizes: `tiny` (the CPU rehearsal in the test suite: seconds on 2 cores), `mid` (5M parameters, the `gpu` size's
batch: a CPU comparison of precisions at a less trivial width) and `gpu` (about 155M parameters, big enough that the
GPU's kernels, not Python, run the step; its CPU reference takes seconds on 16 cores). The model is
a Qwen2 (RMSNorm, SwiGLU, RoPE, GQA, qkv bias, untied head), the family both trainer backends and the engines load,
written with save_pretrained from a seeded init, so every process that builds it gets the same weights.

The batch is one mini-batch of rows of different lengths (so a micro-batch pads), with behaviour logprobs scattered
around a uniform policy's and advantages of both signs: the PPO ratio varies per token, so the loss, the entropy and
the gradient all depend on the model.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

SIZES = {
    "tiny": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rows=4,
        prompt=(4, 9),
        response=(4, 13),
    ),
    "mid": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        rows=8,
        prompt=(16, 64),
        response=(32, 128),
    ),
    "gpu": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        rows=8,
        prompt=(16, 64),
        response=(32, 128),
    ),
}
BATCH_KEYS = ("rows", "prompt", "response")


def build_dense(out: Path, size: str, seed: int = 0) -> Path:
    """A random Qwen2 of `size` saved at `out` (fp32 safetensors); returns `out`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = {k: v for k, v in SIZES[size].items() if k not in BATCH_KEYS}
    config = Qwen2Config(**shape, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(out)
    return out


def batch(size: str, seed: int = 0) -> dict[str, list]:
    """One mini-batch's rows as the trainer takes them: prompt_ids, response_ids, response_logprobs, response_mask,
    advantage."""
    s = SIZES[size]
    rng = np.random.default_rng(seed)
    vocab = s["vocab_size"]
    prompts = [rng.integers(1, vocab, int(rng.integers(*s["prompt"]))).tolist() for _ in range(s["rows"])]
    responses = [rng.integers(1, vocab, int(rng.integers(*s["response"]))).tolist() for _ in range(s["rows"])]
    uniform = -math.log(vocab)
    return {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_logprobs": [(uniform + 0.2 * rng.standard_normal(len(r))).tolist() for r in responses],
        "response_mask": [[1] * len(r) for r in responses],
        "advantage": (0.5 + rng.standard_normal(s["rows"])).tolist(),
    }
