"""The reward step (stages/reward_sources.py): how failures become reward_status, retries, how sources combine, and
what the advantage stage makes of a sample left out. Hand-written fake sources; the real rule stage where it counts
(a custom function that raises)."""

import numpy as np
import pyarrow as pa
import pytest

from stages.advantage import GRPOAdvantage, ReinforcePlusPlusAdvantage, RLOOAdvantage
from stages.reward import Reward
from stages.reward_sources import RewardSources, record, records_of, with_records


def block(rewards: list[float | None], groups: int = 1, source_scores: dict | None = None) -> pa.Table:
    """`groups` groups of len(rewards) samples; the response text carries the score a fake rule gives it (None:
    the rule fails on it)."""
    n = len(rewards)
    rows = [(g, i) for g in range(groups) for i in range(n)]
    table = pa.table(
        {
            "prompt_id": [f"p{g}" for g, _ in rows],
            "sample_id": [f"p{g}/{i}" for g, i in rows],
            "response_text": [repr(rewards[i]) for _, i in rows],
            "ground_truth": ["x"] * len(rows),
            "data_source": ["fake"] * len(rows),
            "response_mask": pa.array([[1, 1, 1]] * len(rows), pa.list_(pa.int8())),
        }
    )
    if source_scores:
        table = with_records(table, [{k: v[i] for k, v in source_scores.items()} for _, i in rows])
    return table


class FakeRule:
    """A rule stage that reads the score from the response text and fails where it says None; `fail_first` fails
    every sample on its first call (a flaky scorer); `seen` keeps the rows it was handed."""

    def __init__(self, fail_first: int = 0) -> None:
        self.calls, self.fail_first, self.seen = 0, fail_first, []

    def __call__(self, batch: pa.Table) -> pa.Table:
        self.calls += 1
        self.seen.append(batch.to_pylist())
        scores = [eval(t) for t in batch["response_text"].to_pylist()]  # noqa: S307 - the fake's own literals
        flaky = self.calls <= self.fail_first
        errors = ["flaky" if flaky else None if s is not None else "parser raised" for s in scores]
        rewards = [0.0 if e else s for s, e in zip(scores, errors, strict=True)]
        batch = batch.append_column("reward", pa.array(rewards, pa.float32()))
        batch = batch.append_column("reward_error", pa.array(errors, pa.string()))
        return batch.append_column("reward_extra_info", pa.nulls(batch.num_rows, pa.string()))


def grpo(table: pa.Table, n: int) -> list[float]:
    return GRPOAdvantage(group_size=n)(table)["advantage"].to_pylist()


def test_zero_biases_the_group_and_mask_does_not():
    """A group whose three scored answers are all right and whose fourth failed to score. Under `zero` the failure
    is a wrong answer: the three right ones get +0.5 each and the unscored one -1.5 (mean 0.75, std 0.5), a signal
    that came from the scorer, not the policy. Under `mask` (the default) the group holds three equal scores: no
    signal, as without the failed sample."""
    scores = [1.0, 1.0, 1.0, None]
    zero = RewardSources(FakeRule(), on_error="zero")(block(scores))
    assert zero["reward_status"].to_pylist() == ["ok", "ok", "ok", "zero"]
    assert grpo(zero, 4) == pytest.approx([0.5, 0.5, 0.5, -1.5], abs=1e-5)
    masked = RewardSources(FakeRule())(block(scores))  # the default policy
    assert masked["reward_status"].to_pylist() == ["ok", "ok", "ok", "masked"]
    assert grpo(masked, 4) == [0.0] * 4


def test_mask_gives_the_scored_members_the_advantages_they_have_without_the_failed_one():
    scores = [0.2, 0.9, None, 0.5]
    masked = GRPOAdvantage(group_size=4)(RewardSources(FakeRule())(block(scores)))
    alone = grpo(block_with_rewards([0.2, 0.9, 0.5]), 3)
    assert [masked["advantage"][i].as_py() for i in (0, 1, 3)] == pytest.approx(alone, abs=1e-6)
    assert masked["advantage"][2].as_py() == 0.0
    # out of the loss: the trainer reads response_mask, and every token advantage is 0 with it
    assert masked["response_mask"].to_pylist()[2] == [0, 0, 0]
    assert masked["token_advantages"].to_pylist()[2] == [0.0, 0.0, 0.0]
    assert masked["response_mask"].to_pylist()[0] == [1, 1, 1]
    # under zero the same members' advantages move
    zero = grpo(RewardSources(FakeRule(), on_error="zero")(block(scores)), 4)
    assert [zero[i] for i in (0, 1, 3)] != pytest.approx(alone, abs=1e-3)


def block_with_rewards(rewards: list[float]) -> pa.Table:
    return pa.table(
        {
            "prompt_id": ["p"] * len(rewards),
            "reward": pa.array(rewards, pa.float32()),
            "response_mask": pa.array([[1, 1, 1]] * len(rewards), pa.list_(pa.int8())),
        }
    )


def test_a_group_left_with_one_member_gives_it_no_advantage():
    out = RewardSources(FakeRule())(block([0.7, None, None]))
    assert grpo(out, 3) == [0.0, 0.0, 0.0]  # a lone member has no peer: not its raw score, as a group of one would
    assert RLOOAdvantage(group_size=3)(out)["advantage"].to_pylist() == [0.0, 0.0, 0.0]


def test_per_token_estimators_leave_a_masked_sample_out():
    out = ReinforcePlusPlusAdvantage(group_size=2)(RewardSources(FakeRule())(block([1.0, None])))
    assert out["token_advantages"].to_pylist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert out["response_mask"].to_pylist() == [[1, 1, 1], [0, 0, 0]]


def test_drop_group_leaves_every_member_of_a_failed_group_out():
    out = RewardSources(FakeRule(), on_error="drop_group")(block2())
    assert out["reward_status"].to_pylist() == ["dropped"] * 3 + ["ok"] * 3
    assert out["reward"].to_pylist() == [1.0, 0.0, 0.5, 1.0, 0.0, 0.5]  # the scored members keep their scores
    adv = GRPOAdvantage(group_size=3)(out)
    assert adv["advantage"].to_pylist()[:3] == [0.0] * 3
    assert adv["response_mask"].to_pylist()[:3] == [[0, 0, 0]] * 3
    assert adv["advantage"].to_pylist()[3:] == pytest.approx(grpo(block_with_rewards([1.0, 0.0, 0.5]), 3), abs=1e-6)


def block2() -> pa.Table:
    """Two groups: p0 has a failure, p1 scores whole."""
    a, b = block([1.0, None, 0.5]), block([1.0, 0.0, 0.5])
    b = b.set_column(0, "prompt_id", pa.array(["p1"] * 3)).set_column(
        1, "sample_id", pa.array(["p1/0", "p1/1", "p1/2"])
    )
    return pa.concat_tables([a, b])


def test_retry_scores_a_flaky_sample_again_and_counts_the_attempts():
    rule = FakeRule(fail_first=1)
    out = RewardSources(rule, on_error="retry", max_attempts=3, backoff_s=0.0)(block([1.0, 0.0]))
    assert rule.calls == 2
    assert out["reward_status"].to_pylist() == ["ok", "ok"]
    assert out["reward_error"].to_pylist() == [None, None]
    assert [r["rule"]["attempts"] for r in records_of(out)] == [2, 2]


def test_retry_gives_up_after_max_attempts_and_masks():
    rule = FakeRule()
    out = RewardSources(rule, on_error="retry", max_attempts=3, backoff_s=0.0)(block([1.0, None]))
    assert rule.calls == 3 and [len(rows) for rows in rule.seen] == [2, 1, 1]  # only the failure is called again
    assert out["reward_status"].to_pylist() == ["ok", "masked"]
    rec = records_of(out)[1]["rule"]
    assert rec["attempts"] == 3 and rec["error"] == "parser raised" and rec["score"] is None
    assert out["reward_error"].to_pylist() == [None, "rule: parser raised"]
    # the other policies make one attempt
    once = FakeRule()
    RewardSources(once, on_error="mask", max_attempts=3)(block([1.0, None]))
    assert once.calls == 1


def test_a_model_source_alone_gives_the_reward():
    scores = {"reward_model": [record(0.8, None, 0.1), record(None, "too long", 0.0)]}
    out = RewardSources(model_sources=("reward_model",))(block([None, None], source_scores=scores))
    assert out["reward"].to_pylist() == pytest.approx([0.8, 0.0])
    assert out["reward_status"].to_pylist() == ["ok", "masked"]
    assert out["reward_error"].to_pylist() == [None, "reward_model: too long"]


def test_a_rule_stage_sees_the_model_scores_and_not_the_samples_a_model_failed():
    scores = {"reward_model": [record(0.8, None, 0.1), record(None, "forward pass failed", 0.2)]}
    rule = FakeRule()
    out = RewardSources(rule, rule_name="custom", model_sources=("reward_model",))(
        block([0.3, 0.4], source_scores=scores)
    )
    (seen,) = rule.seen
    assert [r["sample_id"] for r in seen] == ["p0/0"]
    assert dict(seen[0]["reward_sources"])["reward_model"]["score"] == pytest.approx(0.8)
    assert out["reward"].to_pylist() == pytest.approx([0.3, 0.0])
    assert set(records_of(out)[0]) == {"reward_model", "custom"}
    assert out["reward_error"].to_pylist() == [None, "reward_model: forward pass failed"]


def test_a_custom_function_reads_the_model_score_and_a_raising_one_marks_only_its_sample(tmp_path):
    """The real rule stage with a user's function: a hybrid of the reward model's score and a rule, and a parser that
    raises on some answers: a per-sample error, a masked sample, never a failed block."""
    (tmp_path / "hybrid.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    if solution_str == 'boom':\n"
        "        raise ValueError('cannot parse the answer')\n"
        "    rule = float(solution_str == ground_truth)\n"
        "    return rule + 0.5 * extra_info['reward_scores']['reward_model']\n"
    )
    table = block([None, None, None], source_scores={"reward_model": [record(0.4, None, 0.1)] * 3})
    table = table.set_column(2, "response_text", pa.array(["x", "y", "boom"]))
    stage = Reward(custom_path=str(tmp_path / "hybrid.py"))
    try:
        out = RewardSources(stage, rule_name="custom", model_sources=("reward_model",))(table)
    finally:
        stage.close()
    assert out["reward"].to_pylist() == pytest.approx([1.2, 0.2, 0.0])
    assert out["reward_status"].to_pylist() == ["ok", "ok", "masked"]
    error = out["reward_error"].to_pylist()[2]
    assert error.startswith("custom: custom reward function compute_score raised ValueError: cannot parse")


def test_records_keep_every_source_and_latencies_add_up_over_retries():
    rule = FakeRule(fail_first=2)
    out = RewardSources(rule, on_error="retry", max_attempts=3, backoff_s=0.0)(block([0.5]))
    rec = records_of(out)[0]["rule"]
    assert rec["attempts"] == 3 and rec["score"] == pytest.approx(0.5) and rec["latency_s"] >= 0.0
    assert np.isfinite(rec["latency_s"])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="on_error 'nope'"):
        RewardSources(FakeRule(), on_error="nope")
    with pytest.raises(ValueError, match="exactly one model source"):
        RewardSources(None, model_sources=())
    with pytest.raises(ValueError, match="max_attempts >= 1"):
        RewardSources(FakeRule(), max_attempts=0)
