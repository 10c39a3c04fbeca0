"""pipeline.observe.samples and pipeline.observe.plots on a hand-built run directory whose every number is known."""

import os
import time

import matplotlib
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.observe import plots, samples
from schemas import CONSUMED_SCHEMA, SAMPLE_SCHEMA

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)


def response(prompt: str, index: int, versions: list[int], reward: float, finish: str = "stop") -> dict:
    n = len(versions)
    return {
        "prompt_id": prompt,
        "prompt_text": f"reverse: {prompt} =",
        "prompt_ids": [1, 2],
        "ground_truth": prompt[::-1],
        "data_source": "reverse",
        "admitted_version": versions[0],
        "admitted_time": 0.0,
        "sample_id": f"{prompt}/{index}",
        "response_ids": list(range(n)),
        "response_text": f"answer {index}",
        "response_logprobs": [-0.5] * n,
        "token_param_version": versions,
        "param_version": versions[0],
        "param_version_end": versions[-1],
        "response_mask": [1] * n,
        "num_tokens": n,
        "num_resumes": len(set(versions)) - 1,
        "finish_reason": finish,
        "replica": 0,
        "generated_time": 0.0,
        "gen_latency_s": 0.1,
        "tool_latency_s": 0.0,
        "reward": reward,
        "reward_error": None,
        "advantage": 0.0,
    }


@pytest.fixture
def run_dir(tmp_path):
    """Step 1 trains prompt ab at version 0; step 2 trains cd at version 1, one of its responses partial (0 -> 1).
    Prompt ef was generated but never trained."""
    rows = [
        response("ab", 0, [0, 0, 0], 1.0),
        response("ab", 1, [0, 0, 0, 0], 0.0, "length"),
        response("cd", 0, [0, 0, 1, 1, 1], 0.5),
        response("cd", 1, [1, 1], 1.0),
        response("ef", 0, [1], 0.0),
        response("ef", 1, [1, 2], 0.0),
    ]
    (tmp_path / "samples").mkdir()
    (tmp_path / "consumed").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:3], SAMPLE_SCHEMA), tmp_path / "samples" / "part-a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:], SAMPLE_SCHEMA), tmp_path / "samples" / "part-b.parquet")
    for step, version, prompt in [(1, 0, "ab"), (2, 1, "cd")]:
        consumed = [
            {"sample_id": f"{prompt}/{i}", "prompt_id": prompt, "consumed_version": version, "consumed_step": step}
            for i in range(2)
        ]
        table = pa.Table.from_pylist([{**c, "consumed_time": 0.0} for c in consumed], CONSUMED_SCHEMA)
        pq.write_table(table, tmp_path / "consumed" / f"step-{step:07d}.parquet")
    return tmp_path


def test_reward_curve(run_dir):
    curve = samples.reward_curve(run_dir)
    assert curve["consumed_step"].tolist() == [1, 2]
    assert curve["reward_mean"].tolist() == [0.5, 0.75]
    assert curve["samples"].tolist() == [2, 2]
    assert curve["consumed_version"].tolist() == [0, 1]


def test_lag_histogram(run_dir):
    hist = samples.lag_histogram(run_dir)
    # ab/*: 0 - 0; cd/0: 1 - 0 (its first token is version 0); cd/1: 1 - 1
    assert hist.to_dict("list") == {"lag": [0, 1], "samples": [3, 1], "share": [0.75, 0.25]}


def test_version_runs():
    assert samples.version_runs([0, 0, 1, 1, 1]) == [(0, 0, 2), (1, 2, 3)]
    assert samples.version_runs([3]) == [(3, 0, 1)]
    assert samples.version_runs([]) == []


def test_version_spans_of_partial_responses_only(run_dir):
    spans = samples.version_spans(run_dir).sort_values(["sample_id", "start_token"], ignore_index=True)
    assert spans[["sample_id", "version", "start_token", "length"]].values.tolist() == [
        ["cd/0", 0, 0, 2],
        ["cd/0", 1, 2, 3],
        ["ef/1", 1, 0, 1],
        ["ef/1", 2, 1, 1],
    ]
    assert set(spans["num_resumes"]) == {1}


def test_response_lengths(run_dir):
    lengths = samples.response_lengths(run_dir).set_index("sample_id")
    assert len(lengths) == 6
    assert lengths.loc["ab/1", "num_tokens"] == 4 and lengths.loc["ab/1", "finish_reason"] == "length"
    assert lengths["partial"].sum() == 2


def test_side_by_side_defaults_to_the_last_step(run_dir):
    df = samples.side_by_side(run_dir)
    assert df["sample_id"].tolist() == ["cd/0", "cd/1"]
    assert df["reward"].tolist() == [0.5, 1.0]
    assert df["prompt_text"].tolist() == ["reverse: cd =", "reverse: cd ="]
    assert df["param_version_end"].tolist() == [1, 1]
    assert samples.side_by_side(run_dir, step=1)["sample_id"].tolist() == ["ab/0", "ab/1"]
    with pytest.raises(ValueError, match="from 1 to 2"):
        samples.side_by_side(run_dir, step=9)


def test_missing_run_dir_names_path_and_fix(tmp_path):
    with pytest.raises(samples.RunLogError, match=f"{tmp_path / 'nope'} does not exist.*ASYNCRL_RUN_DIR"):
        samples.reward_curve(tmp_path / "nope")


def test_missing_logs_name_the_log(run_dir):
    for shard in (run_dir / "consumed").iterdir():
        shard.unlink()
    with pytest.raises(samples.RunLogError, match=f"{run_dir / 'consumed'} has no Parquet files"):
        samples.lag_histogram(run_dir)
    assert len(samples.response_lengths(run_dir)) == 6  # the sample log alone still reads
    with pytest.raises(samples.RunLogError, match="samples has no Parquet files"):
        samples.version_spans(run_dir.parent)


def test_latest_run(tmp_path):
    with pytest.raises(samples.RunLogError, match="no run directory under"):
        samples.latest_run(tmp_path / "runs")
    for name, age in [("old", 100), ("new", 0)]:
        (tmp_path / "runs" / name).mkdir(parents=True)
        os.utime(tmp_path / "runs" / name, (time.time() - age, time.time() - age))
    assert samples.latest_run(tmp_path / "runs").name == "new"


def test_plots_draw_every_table(run_dir):
    fig, axes = plt.subplots(2, 2)
    plots.reward_curve(samples.reward_curve(run_dir), axes[0, 0])
    plots.lag_histogram(samples.lag_histogram(run_dir), axes[0, 1])
    plots.version_spans(samples.version_spans(run_dir), axes[1, 0])
    plots.response_lengths(samples.response_lengths(run_dir), axes[1, 1])
    assert len(axes[0, 0].lines) == 2
    assert [t.get_text() for t in axes[1, 0].get_yticklabels()] == ["cd/0", "ef/1"]
    assert axes[1, 1].get_legend() is not None
    fig.canvas.draw()
    plt.close(fig)
