"""The reward-model stage (stages/reward_model.py) with a tiny random sequence-classification model built here: its
micro-batched, padded scores equal one-by-one forward passes, the reward model's own chat template renders the input,
and bad input is a per-sample error (too long) or one clear message (a directory that is no reward model)."""

import json

import pyarrow as pa
import pytest
import torch

from pipeline.tasks.embedded import build_model, build_tokenizer
from stages.reward_model import RewardModel, check_model_dir
from stages.reward_sources import records_of

# A chat template of the reward model's own, with roles (the policy's tokenizer has none).
CHAT_TEMPLATE = "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A random Qwen2ForSequenceClassification of the embedded shape with the embedded tokenizer and a chat template."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    policy = tmp_path_factory.mktemp("policy")
    tokenizer = build_tokenizer(policy, seed=0)
    build_model(policy, len(tokenizer), seed=0)
    out = tmp_path_factory.mktemp("rm")
    config = AutoConfig.from_pretrained(policy, num_labels=1)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def block(prompts: list[str], responses: list[str]) -> pa.Table:
    return pa.table(
        {"sample_id": [f"s{i}" for i in range(len(prompts))], "prompt_text": prompts, "response_text": responses}
    )


PROMPTS = ["reverse: a b c =", "reverse: q =", "reverse: x y z w v u =", "reverse: k m ="]
RESPONSES = [" c b a", " q", " u v w x y z z z", " m"]


def test_micro_batched_scores_equal_one_by_one_forward_passes(rm_dir):
    stage = RewardModel(str(rm_dir), micro_batch_size=3)
    recs = [r["reward_model"] for r in records_of(stage(block(PROMPTS, RESPONSES)))]
    alone = []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        text = stage.tokenizer.apply_chat_template(chat, tokenize=False)
        assert text == f"user: {prompt}\nassistant: {response}\n"  # the reward model's own template
        ids = torch.tensor([stage.tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            alone.append(stage.model(input_ids=ids).logits[0, -1].item())
    assert [r["score"] for r in recs] == pytest.approx(alone, abs=1e-5)
    assert all(r["error"] is None and r["attempts"] == 1 and r["latency_s"] > 0 for r in recs)
    # one micro-batch of 3 and one of 1: the first three share their pass's latency
    assert recs[0]["latency_s"] == recs[1]["latency_s"] == recs[2]["latency_s"]
    assert len(set(alone)) == 4  # the scores differ: the padding did not make them alike


def test_an_input_too_long_is_its_own_error(rm_dir):
    stage = RewardModel(str(rm_dir), max_length=30)
    recs = [r["reward_model"] for r in records_of(stage(block(PROMPTS, RESPONSES)))]
    assert recs[2]["score"] is None and "more than the reward model takes (30" in recs[2]["error"]
    assert all(r["error"] is None for i, r in enumerate(recs) if i != 2)


def test_a_failing_forward_pass_fails_its_samples_and_is_retried_alone(rm_dir, monkeypatch):
    stage = RewardModel(str(rm_dir), micro_batch_size=4, max_attempts=2)
    forward, calls = stage._forward, []

    def flaky(rows):
        calls.append(len(rows))
        if len(rows) > 1:
            raise RuntimeError("CUDA out of memory")
        return forward(rows)

    monkeypatch.setattr(stage, "_forward", flaky)
    recs = [r["reward_model"] for r in records_of(stage(block(PROMPTS, RESPONSES)))]
    assert calls == [4, 1, 1, 1, 1]
    assert all(r["error"] is None and r["attempts"] == 2 for r in recs)
    once = RewardModel(str(rm_dir), micro_batch_size=4)
    monkeypatch.setattr(once, "_forward", lambda rows: (_ for _ in ()).throw(RuntimeError("CUDA out of memory")))
    failed = [r["reward_model"] for r in records_of(once(block(PROMPTS, RESPONSES)))]
    assert all(r["error"] == "forward pass failed: RuntimeError: CUDA out of memory" for r in failed)


def test_a_directory_that_is_no_reward_model_is_one_clear_message(rm_dir, tmp_path):
    assert check_model_dir(str(rm_dir)) is None
    assert "has no config.json" in check_model_dir(str(tmp_path / "missing"))
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    assert "holds a Qwen2ForCausalLM, not a sequence-classification model" in check_model_dir(str(tmp_path / "lm"))
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"]}))
    assert "has no tokenizer" in check_model_dir(str(tmp_path / "bare"))
    with pytest.raises(ValueError, match="has no config.json"):
        RewardModel(str(tmp_path / "missing"))
