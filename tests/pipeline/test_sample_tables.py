"""pipeline.observe.samples on a real partial-rollout run: the tables agree with the summary and each other."""

import pytest

from pipeline.observe import samples


@pytest.mark.slow
def test_tables_of_a_real_run(partial_run):
    summary, run_dir = partial_run
    steps, group = summary["steps"], 4  # rollout.n

    curve = samples.reward_curve(run_dir)
    assert curve["consumed_step"].tolist() == list(range(1, steps + 1))
    assert (curve["samples"] == 4 * group).all()  # ppo_mini_batch_size prompts x rollout.n per step

    hist = samples.lag_histogram(run_dir)
    assert hist["samples"].sum() == summary["samples_consumed"]
    assert hist["lag"].max() <= summary["lag_bound"]

    lengths = samples.response_lengths(run_dir).set_index("sample_id")
    spans = samples.version_spans(run_dir)
    partial = spans["sample_id"].nunique()
    assert partial > 0, "no weight sync landed in the middle of a response"
    assert partial == lengths["partial"].sum()
    for sample_id, runs in spans.groupby("sample_id"):
        runs = runs.sort_values("start_token")
        # the runs tile the response: contiguous, covering every token, each newer than the one before
        assert runs["start_token"].tolist() == [0, *runs["length"].cumsum().tolist()[:-1]]
        assert runs["length"].sum() == lengths.loc[sample_id, "num_tokens"]
        assert runs["version"].is_monotonic_increasing and runs["version"].is_unique

    side = samples.side_by_side(run_dir, prompts=2)
    assert len(side) == 2 * group and side["prompt_id"].nunique() == 2
    assert (side["consumed_step"] == steps).all()
