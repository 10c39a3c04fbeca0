"""The judge stage's logic (stages/judge.py) over a stand-in engine that answers every prompt with its tokens
reversed: the user's prompt and parser functions, the verdict on record, and every way a sample's judging can fail
(a prompt function or parser that raises, a score that is no number, a prompt too long) as that sample's error while
the others are scored; retries under max_attempts; a dead engine ends the run. The real engine judges in the stream:
tests/pipeline/test_rewards.py."""

import pyarrow as pa
import pytest

from pipeline.tasks.embedded import build_tokenizer
from stages.agents import Segment
from stages.judge import Judge, JudgeEngineDied
from stages.reward_sources import records_of
from stages.user_code import UserCodeError

JUDGE_FILE = """
import zlib

CALLS = {}


def judge_prompt(prompt, response, ground_truth, data_source):
    if response == "bad prompt":
        raise KeyError("no template for this one")
    if response == "chat":
        return [{"role": "user", "content": prompt + response}]
    return prompt + " " + response


def judge_score(verdict, prompt, response, ground_truth, data_source):
    CALLS[response] = CALLS.get(response, 0) + 1
    if response == "bad parse":
        raise ValueError("no verdict in " + repr(verdict))
    if response == "flaky" and CALLS[response] == 1:
        raise ValueError("first time unlucky")
    if response == "nan":
        return float("nan")
    return len(verdict) / 100
"""


class Reverser:
    """An Engine that answers with the prompt's tokens reversed (or dies when told to)."""

    name = "reverser"

    def __init__(self) -> None:
        self.prompts, self.dead, self.started = [], False, False

    async def start(self, version):
        self.started = True

    async def generate(self, prompt, max_tokens, request_id, sampling):
        if self.dead:
            raise RuntimeError("engine core gone")
        self.prompts.append((list(prompt), max_tokens, sampling.temperature))
        return Segment(list(reversed(prompt))[:max_tokens], [0.0] * min(len(prompt), max_tokens), [0], "stop")

    def died(self, err):
        return self.dead

    def shutdown(self):
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("judge")
    tokenizer = build_tokenizer(out, seed=0)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tokenizer.save_pretrained(out)
    (out / "judge.py").write_text(JUDGE_FILE)
    return out


def judge(model_dir, **kw) -> tuple[Judge, Reverser]:
    engine = Reverser()
    return Judge(
        str(model_dir), str(model_dir / "judge.py"), max_tokens=32, max_model_len=96, engine=engine, **kw
    ), engine


def block(responses: list[str]) -> pa.Table:
    n = len(responses)
    return pa.table(
        {
            "sample_id": [f"s{i}" for i in range(n)],
            "prompt_text": ["abc"] * n,
            "response_text": responses,
            "ground_truth": ["cba"] * n,
            "data_source": ["reverse"] * n,
        }
    )


def test_each_sample_is_judged_and_its_verdict_parsed(model_dir):
    stage, engine = judge(model_dir)
    assert engine.started
    out = records_of(stage(block(["cba", "chat", "bad prompt", "bad parse", "nan", "x" * 400])))
    tokenizer = stage.tokenizer
    good = out[0]["judge"]
    # the verdict is the engine's answer decoded, and the score the parser's reading of it
    expected = tokenizer.decode(list(reversed(tokenizer("abc cba", add_special_tokens=False)["input_ids"])))
    assert good["output"] == expected and good["score"] == pytest.approx(len(expected) / 100)
    assert good["error"] is None and good["attempts"] == 1 and good["latency_s"] > 0
    # chat messages go through the judge tokenizer's template, with the generation prompt
    chat_ids = tokenizer("user: abcchat\nassistant:", add_special_tokens=False)["input_ids"]
    assert [p for p, _, _ in engine.prompts].count(chat_ids) == 1 and out[1]["judge"]["error"] is None
    assert "judge_prompt raised KeyError" in out[2]["judge"]["error"] and out[2]["judge"]["score"] is None
    assert "judge_score raised ValueError: no verdict" in out[3]["judge"]["error"] and out[3]["judge"]["output"]
    assert "judge_score returned nan: expected a finite number" in out[4]["judge"]["error"]
    assert "the judge's prompt has" in out[5]["judge"]["error"] and "it takes 1 to 64" in out[5]["judge"]["error"]
    assert len(engine.prompts) == 4  # the two samples without a prompt never reached the engine
    assert all(t == 0.0 and m == 32 for _, m, t in engine.prompts)  # greedy, the verdict's budget


def test_a_failed_judging_is_tried_again_under_max_attempts(model_dir):
    stage, _ = judge(model_dir, max_attempts=2)
    flaky, always = records_of(stage(block(["flaky", "bad parse"])))
    assert flaky["judge"]["error"] is None and flaky["judge"]["attempts"] == 2
    assert always["judge"]["error"] and always["judge"]["attempts"] == 2


def test_chat_messages_without_a_chat_template_are_the_samples_error(model_dir, tmp_path):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(model_dir)
    plain.chat_template = None
    plain.save_pretrained(tmp_path)
    stage = Judge(str(tmp_path), str(model_dir / "judge.py"), max_model_len=96, max_tokens=32, engine=Reverser())
    chat, text = records_of(stage(block(["chat", "cba"])))
    assert "the judge's chat template cannot render judge_prompt's messages" in chat["judge"]["error"]
    assert text["judge"]["error"] is None


def test_a_dead_engine_ends_the_run_with_its_cause(model_dir):
    stage, engine = judge(model_dir)
    engine.dead = True
    with pytest.raises(JudgeEngineDied, match="the judge's vLLM engine died: RuntimeError: engine core gone"):
        stage(block(["cba"]))


def test_a_file_without_both_functions_is_one_error(model_dir, tmp_path):
    (tmp_path / "half.py").write_text("def judge_prompt(*a):\n    return ''\n")
    with pytest.raises(ValueError, match="defines no judge_score"):
        Judge(str(model_dir), str(tmp_path / "half.py"), engine=Reverser())
    with pytest.raises(UserCodeError, match="no such file"):
        Judge(str(model_dir), str(tmp_path / "none.py"), engine=Reverser())
