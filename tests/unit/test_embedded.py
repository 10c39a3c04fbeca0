"""The embedded task: data, tokenizer, verifier, model directory and warm start, all offline and fast."""

import random
from collections import Counter

import pyarrow.parquet as pq
import pytest

from pipeline.tasks.embedded import DATA_SOURCE, LETTERS, MAX_LETTERS, build_embedded, make_rows
from stages.verifiers import VERIFIERS, score_reverse


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return build_embedded(tmp_path_factory.mktemp("embedded"), num_prompts=64, seed=3)


@pytest.fixture(scope="module")
def tokenizer(task):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(task.model_dir, local_files_only=True)


def test_rows_are_deterministic_reversals():
    rows = make_rows(500, seed=7)
    assert rows == make_rows(500, seed=7)
    assert rows != make_rows(500, seed=8)
    for row in rows:
        assert row["data_source"] == DATA_SOURCE
        letters = row["prompt_text"].removeprefix("reverse:").removesuffix("=").split()
        assert row["ground_truth"].split() == letters[::-1]
        assert len(set(letters)) == len(letters) and set(letters) <= set(LETTERS)


def test_lengths_are_long_tailed():
    lengths = Counter(len(r["ground_truth"].split()) for r in make_rows(5000, seed=0))
    assert min(lengths) == 1 and max(lengths) <= MAX_LETTERS
    share = {k: v / 5000 for k, v in lengths.items()}
    assert sum(share.get(k, 0) for k in (1, 2, 3)) > 0.3  # most lists are short ...
    assert sum(share.get(k, 0) for k in range(12, MAX_LETTERS + 1)) > 0.05  # ... and some are long
    assert all(share[k] >= share[k + 1] * 0.7 for k in range(1, 10))  # decreasing, bar sampling noise


def test_tokenizer_round_trips_with_one_token_per_letter(tokenizer):
    prompt = "reverse: c a f e ="
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == prompt
    assert len(ids) == 4 + 3  # 'reverse', ':', four letters, ' ='
    for letter in LETTERS:
        assert len(tokenizer(" " + letter, add_special_tokens=False)["input_ids"]) == 1
    answer = tokenizer(" e f a c", add_special_tokens=False)["input_ids"]
    assert answer == ids[2:6][::-1]  # reversal is token-level
    assert len(tokenizer) <= 512
    assert tokenizer.eos_token_id != tokenizer.pad_token_id


def test_tokenizer_encodes_anything(tokenizer):
    text = "Über 3 ünïcode → ok\n\t!"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_verifier_scores():
    assert VERIFIERS["reverse"] is score_reverse
    assert score_reverse("e f a c", "e f a c") == 1.0
    assert score_reverse("  e f a c <|endoftext|>", "e f a c") == 1.0
    assert score_reverse("e f x c", "e f a c") == 0.5
    assert 0.0 < score_reverse("e f", "e f a c") < 1.0
    assert 0.0 < score_reverse("e f a c d", "e f a c") < 1.0
    assert score_reverse("", "e f a c") == 0.0
    assert score_reverse("c a f e", "e f a c") == 0.0


@pytest.mark.parametrize("bad", [None, 3, b"e f", ["e"], "\x00\ufffd", "<|endoftext|>", "  \n "])
def test_verifier_never_raises(bad):
    assert score_reverse(bad, "e f a c") == 0.0
    assert 0.0 <= score_reverse("e f a c", bad) <= 1.0


def test_verifier_stays_in_range():
    rng = random.Random(0)
    for _ in range(300):
        truth = " ".join(rng.sample(LETTERS, rng.randint(1, 6)))
        response = " ".join(rng.choice(LETTERS + "=") for _ in range(rng.randint(0, 8)))
        assert 0.0 <= score_reverse(response, truth) <= 1.0


def test_build_embedded_gives_a_loadable_model(task, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(task.model_dir, local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "qwen2" and not cfg.tie_word_embeddings
    assert cfg.hidden_size // cfg.num_attention_heads in (32, 64, 80, 96, 112, 128)  # vLLM CPU attention
    assert cfg.vocab_size == len(tokenizer)
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert str(model.dtype) == "torch.float32"
    assert (task.model_dir / "model.safetensors").exists()
    table = pq.read_table(task.data_file)
    assert table.column_names == ["prompt_text", "ground_truth", "data_source"] and table.num_rows == 64


def test_the_moe_model_fits_vllm_cpu_experts(tmp_path, tokenizer):
    """model.arch=moe: a Qwen3-MoE whose hidden and expert sizes vLLM's CPU MoE kernel takes (multiples of 32)."""
    from transformers import AutoModelForCausalLM

    from pipeline.tasks.embedded import build_model

    build_model(tmp_path, len(tokenizer), seed=0, arch="moe")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and (cfg.num_experts, cfg.num_experts_per_tok) == (4, 2)
    assert cfg.hidden_size % 32 == 0 and cfg.moe_intermediate_size % 32 == 0 and cfg.head_dim == 32
    with pytest.raises(ValueError, match="model.arch must be one of"):
        build_model(tmp_path, len(tokenizer), seed=0, arch="sparse")


def test_build_embedded_is_deterministic(task, tmp_path):
    again = build_embedded(tmp_path, num_prompts=64, seed=3)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again.model_dir / name).read_bytes() == (task.model_dir / name).read_bytes()
    assert pq.read_table(again.data_file).equals(pq.read_table(task.data_file))


def test_warm_start_lowers_the_loss_and_saves(tmp_path):
    from transformers import AutoModelForCausalLM

    from pipeline.tasks.warmstart import warm_start

    fresh = build_embedded(tmp_path, num_prompts=64, seed=0)
    stats = warm_start(fresh.model_dir, fresh.data_file, steps=20, lr=2e-3, seed=0, batch_size=8)
    assert stats["steps"] == 20 and stats["final_loss"] < stats["first_loss"]
    AutoModelForCausalLM.from_pretrained(fresh.model_dir, local_files_only=True)


def test_a_warm_start_is_trained_once_per_inputs_and_then_loaded(tmp_path):
    from pipeline.tasks.warmstart import cached_warm_start

    cache = tmp_path / "cache"

    def run(name: str, lr: float = 2e-3) -> tuple[dict, bytes]:
        task = build_embedded(tmp_path / name, num_prompts=64, seed=0)
        stats = cached_warm_start(task.model_dir, task.data_file, 5, lr, 0, 0.5, str(cache))
        return stats, (task.model_dir / "model.safetensors").read_bytes()

    first, trained = run("first")
    second, loaded = run("second")
    assert "cached" not in first and second["cached"].startswith(str(cache))
    assert loaded == trained and second["final_loss"] == first["final_loss"]
    other, other_weights = run("other", lr=1e-3)  # another input: trained, not the first one's model
    assert "cached" not in other and other_weights != trained
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2
    again = build_embedded(tmp_path / "off", num_prompts=64, seed=0)  # '' trains, though the cache holds it
    assert "cached" not in cached_warm_start(again.model_dir, again.data_file, 5, 2e-3, 0, 0.5, "")
