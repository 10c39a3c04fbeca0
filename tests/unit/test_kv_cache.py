"""A CPU engine's KV cache (stages/engines/vllm_core.py, kv_cache_bytes): fitted to the most sequences the engine runs
at once, or the GiB the config gives. The fit is pure arithmetic on config.json; the last test checks its two
assumptions about vLLM (the most sequences an AsyncLLM runs, the block size a CPU engine pages in) against vLLM's own
resolved configuration of a model built here."""

import json
import os

import pytest

from pipeline.tasks.embedded import build_model, build_tokenizer
from stages.engines.vllm_core import DEFAULT_MAX_NUM_SEQS, GIB, KV_BLOCK, KV_CACHE_CAP, kv_cache_bytes

# The embedded job's model: 2 layers, 4 heads of 32 (hidden 128), 2 KV heads.
TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
# keys and values x layers x KV heads x head size x 4 bytes, and the 10/8 a CPU engine's pages take beyond them
PER_TOKEN_FP32 = 2 * 2 * 2 * 32 * 4 * 10 // 8


def test_the_fit_holds_the_most_sequences_at_the_longest_length():
    # 112 tokens round up to one block of KV_BLOCK; 128 sequences: 40 MiB, where the fixed size was 1 GiB.
    assert kv_cache_bytes(TINY, None, 112, "float32", {}) == DEFAULT_MAX_NUM_SEQS * KV_BLOCK * PER_TOKEN_FP32
    assert kv_cache_bytes(TINY, None, 257, "float32", {}) == DEFAULT_MAX_NUM_SEQS * 2 * KV_BLOCK * PER_TOKEN_FP32
    assert kv_cache_bytes(TINY, None, 112, "bfloat16", {}) == DEFAULT_MAX_NUM_SEQS * KV_BLOCK * PER_TOKEN_FP32 // 2


def test_the_engines_own_limits_move_the_fit():
    base = kv_cache_bytes(TINY, None, 112, "float32", {})
    assert kv_cache_bytes(TINY, None, 112, "float32", {"max_num_seqs": 256}) == 2 * base
    assert kv_cache_bytes(TINY, None, 112, "float32", {"block_size": 512}) == 2 * base  # 512-token blocks
    assert kv_cache_bytes(TINY, None, 112, "float32", {"block_size": 32}) == base  # never below KV_BLOCK
    assert kv_cache_bytes(TINY, None, 112, "float32", {}, ranks=2) == base // 2  # each rank holds one KV head
    assert kv_cache_bytes(TINY, None, 112, "float32", {}, ranks=4) == base // 2  # 2 heads over 4 ranks: one each


def test_head_size_and_kv_heads_come_from_the_config_when_it_says_them():
    assert kv_cache_bytes({**TINY, "head_dim": 64}, None, 112, "float32", {}) == 2 * kv_cache_bytes(
        TINY, None, 112, "float32", {}
    )
    no_gqa = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}  # every head has its own KV
    assert kv_cache_bytes(no_gqa, None, 112, "float32", {}) == 2 * kv_cache_bytes(TINY, None, 112, "float32", {})
    vl = {"model_type": "qwen2_5_vl", "text_config": TINY}
    assert kv_cache_bytes(vl, None, 112, "float32", {}) == kv_cache_bytes(TINY, None, 112, "float32", {})


def test_given_gib_win_and_the_fit_never_passes_the_cap():
    assert kv_cache_bytes(TINY, 0.25, 112, "float32", {}) == GIB // 4
    assert kv_cache_bytes(TINY, 3, 112, "float32", {}) == 3 * GIB  # given: not capped
    big = {**TINY, "num_hidden_layers": 80, "num_key_value_heads": 8, "head_dim": 128}
    assert kv_cache_bytes(big, None, 32768, "bfloat16", {}) == KV_CACHE_CAP


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "mystery"},  # no head counts
        {**TINY, "layer_types": ["full_attention", "mamba"]},  # a hybrid: its state is not KV heads
        {**TINY, "num_attention_heads": 0},
    ],
)
def test_a_config_the_fit_cannot_read_gets_the_cap(config):
    assert kv_cache_bytes(config, None, 112, "float32", {}) == KV_CACHE_CAP


def test_sliding_window_layers_are_fitted_as_full_ones():  # an upper bound: a window holds at most that much
    windows = {**TINY, "layer_types": ["full_attention", "sliding_attention"]}
    assert kv_cache_bytes(windows, None, 112, "float32", {}) == kv_cache_bytes(TINY, None, 112, "float32", {})


def test_vllm_resolves_what_the_fit_assumes(tmp_path):
    """An AsyncLLM's engine (vLLM's ENGINE_CONTEXT) runs at most DEFAULT_MAX_NUM_SEQS sequences, in blocks of at most
    KV_BLOCK tokens, and takes the fitted bytes as its cache."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    build_model(tmp_path, vocab_size=len(build_tokenizer(tmp_path, seed=0)), seed=0)
    config = json.loads((tmp_path / "config.json").read_text())
    fit = kv_cache_bytes(config, None, 112, "float32", {})
    args = AsyncEngineArgs(model=str(tmp_path), max_model_len=112, dtype="float32", kv_cache_memory_bytes=fit)
    saved = dict(os.environ)  # vLLM's CPU platform sets variables (LD_PRELOAD among them) the next tests would inherit
    try:
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert vllm_config.scheduler_config.max_num_seqs == DEFAULT_MAX_NUM_SEQS
    assert vllm_config.cache_config.block_size <= KV_BLOCK
    assert vllm_config.cache_config.kv_cache_memory_bytes == fit
    model = vllm_config.model_config
    kv = 2 * model.get_num_layers(vllm_config.parallel_config) * model.get_total_num_kv_heads() * model.get_head_size()
    assert fit == DEFAULT_MAX_NUM_SEQS * KV_BLOCK * kv * 4 * 10 // 8
