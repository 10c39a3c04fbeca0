"""bench.peers' generation-heavy workload (b): a model of tens of millions of parameters writing a few hundred tokens.

The embedded job's responses are at most 48 tokens from a 0.47M-parameter model, so fixed per-step costs decide
its speed. Workload (b) is the other end: the embedded tokenizer and prompts, a random-init Qwen2 of LONG_PARAMS
parameters, responses up to LONG_RESPONSE tokens, and a reward that pays for long answers made of letters:

    reward = min(1, single-letter items in the response / LETTER_TARGET)

A random model writes one of the 26 letter tokens (" a" .. " z") about one time in eleven and EOS about one time in
300, so its answers run long (a geometric tail cut at LONG_RESPONSE) and score ~0.1; GRPO raises the reward by
moving probability onto the letters and off EOS, a direction every group agrees on, so a run reaches 0.6-0.8 in
tens of steps without a warm start. The answers stay long while it learns. Measured on 2 cores, the trainer's
step, not generation, is most of asyncrl's step here (docs/benchmarks.md, "Against TRL").

This file is imported by both sides: by asyncrl as its custom reward function (`compute_score`) and by the TRL
side in its own virtualenv (`letters_score`); so it imports only the standard library at the top.
"""

from __future__ import annotations

from pathlib import Path

LONG_RESPONSE = 256  # max tokens per response
LETTER_TARGET = 128  # single-letter items for a reward of 1.0
# The model: hidden 512 / 8 heads = head_dim 64 (vLLM's CPU attention takes it), 6 layers, 2 kv heads: ~19M
# parameters, 40x the embedded model's 0.47M.
LONG_SHAPE = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_hidden_layers=6,
    intermediate_size=1536,
    max_position_embeddings=512,  # prompt + LONG_RESPONSE must fit
)
LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")


def letters_score(response_text: str) -> float:
    """min(1, the response's whitespace-separated items that are one lower-case letter / LETTER_TARGET)."""
    if not isinstance(response_text, str):
        return 0.0
    return min(1.0, sum(1 for item in response_text.split() if item in LETTERS) / LETTER_TARGET)


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **kwargs) -> float:
    """asyncrl's custom reward function (custom_reward_function.name=compute_score): letters_score."""
    return letters_score(solution_str)


def build_long_model(out_dir: Path, tokenizer_dir: Path, seed: int) -> int:
    """A random-init float32 Qwen2 of LONG_SHAPE with the tokenizer of tokenizer_dir, saved to out_dir; returns its
    parameter count."""
    import shutil

    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    for path in Path(tokenizer_dir).iterdir():
        if "token" in path.name:
            shutil.copy2(path, out_dir / path.name)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **LONG_SHAPE,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())
