"""A run's Arrow logs as tidy tables, for notebooks/: one row per observation, pandas DataFrames.

Reads `<run>/samples` (every generated response, schemas.SAMPLE_SCHEMA) and `<run>/consumed` (what the trainer
trained on, at which version and step) with `pyarrow.dataset`, loading only the columns a table needs: a long
run's token lists are most of its log. Works on a run that is still going, since both logs grow shard by shard.
Nothing here writes. Plots of these tables are in pipeline.observe.plots.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds

RUN_DIR_ENV = "ASYNCRL_RUN_DIR"


class RunLogError(FileNotFoundError):
    """A run directory or one of its logs is missing; the message names the path and what to do."""


def latest_run(root: str | Path = "runs") -> Path:
    """The most recently modified run directory under `root` (trainer.output_dir)."""
    root = Path(root)
    runs = [p for p in root.iterdir() if p.is_dir()] if root.is_dir() else []
    if not runs:
        raise RunLogError(
            f"no run directory under {root.resolve()}: start one with `asyncrl run`, or set {RUN_DIR_ENV} "
            f"to a run directory (the path `asyncrl run` prints)"
        )
    return max(runs, key=lambda p: p.stat().st_mtime)


def _log(run_dir: str | Path, name: str) -> pds.Dataset:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunLogError(
            f"run directory {run_dir.resolve()} does not exist: set {RUN_DIR_ENV} (or pass the path) to a directory "
            f"that `asyncrl run` created, e.g. runs/<name>"
        )
    path = run_dir / name
    if not any(path.glob("*.parquet")):
        what = {
            "samples": "no response was generated yet (or this is not an asyncrl run directory)",
            "consumed": "the trainer has not finished a step yet (or the run stopped before its first one)",
        }[name]
        raise RunLogError(f"{path} has no Parquet files: {what}. Pick another run or wait for this one.")
    return pds.dataset(str(path), format="parquet")


def read_samples(run_dir: str | Path, columns: list[str], partial_only: bool = False) -> pa.Table:
    """Columns of the sample log; `partial_only` keeps responses written by more than one weight version."""
    # Versions never decrease along a response (the audit checks it), so it spans versions iff oldest != newest.
    where = pc.field("param_version") != pc.field("param_version_end") if partial_only else None
    return _log(run_dir, "samples").to_table(columns=columns, filter=where)


def read_trained(run_dir: str | Path, columns: list[str]) -> pa.Table:
    """The consumption log joined with the named sample-log columns: one row per trained response."""
    consumed = _log(run_dir, "consumed").to_table()
    samples = read_samples(run_dir, ["sample_id", *[c for c in columns if c not in consumed.column_names]])
    return consumed.join(samples, "sample_id", join_type="inner")


def reward_curve(run_dir: str | Path) -> pd.DataFrame:
    """Per trainer step: mean and std of the reward of the responses it trained on, their count and version."""
    trained = read_trained(run_dir, ["reward"])
    table = trained.group_by("consumed_step").aggregate(
        [("reward", "mean"), ("reward", "stddev"), ("reward", "count"), ("consumed_version", "max")]
    )
    df = table.to_pandas().rename(
        columns={
            "reward_stddev": "reward_std",
            "reward_count": "samples",
            "consumed_version_max": "consumed_version",
        }
    )
    return df.sort_values("consumed_step", ignore_index=True)


def lag_histogram(run_dir: str | Path) -> pd.DataFrame:
    """Trained responses per lag (consumed_version - param_version: how many syncs old their first token was)."""
    trained = read_trained(run_dir, ["param_version"])
    lags = pc.subtract(trained["consumed_version"], trained["param_version"]).to_numpy()
    values, counts = np.unique(lags, return_counts=True)
    df = pd.DataFrame({"lag": values.astype(int), "samples": counts.astype(int)})
    df["share"] = df["samples"] / max(int(counts.sum()), 1)
    return df


def version_runs(versions: list[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """[0, 0, 1, 1, 1] -> [(0, 0, 2), (1, 2, 3)]: (version, start_token, length) of each run of equal versions."""
    v = np.asarray(versions)
    if v.size == 0:
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(v)) + 1])
    lengths = np.diff(np.concatenate([starts, [v.size]]))
    return [(int(v[s]), int(s), int(n)) for s, n in zip(starts, lengths, strict=True)]


def version_spans(run_dir: str | Path) -> pd.DataFrame:
    """Partial responses (tokens from more than one weight version): one row per run of equal token versions."""
    table = read_samples(run_dir, ["sample_id", "token_param_version", "num_resumes"], partial_only=True)
    rows = [
        (sample_id, resumes, *run)
        for sample_id, versions, resumes in zip(
            table["sample_id"].to_pylist(),
            table["token_param_version"].to_pylist(),
            table["num_resumes"].to_pylist(),
            strict=True,
        )
        for run in version_runs(versions)
    ]
    df = pd.DataFrame(rows, columns=["sample_id", "num_resumes", "version", "start_token", "length"])
    return df.astype({"num_resumes": int, "version": int, "start_token": int, "length": int})


def response_lengths(run_dir: str | Path) -> pd.DataFrame:
    """Every generated response: its length, why it ended, and whether it spans weight versions."""
    table = read_samples(run_dir, ["sample_id", "num_tokens", "finish_reason", "param_version", "param_version_end"])
    df = table.to_pandas()
    df["partial"] = df["param_version"] != df["param_version_end"]
    return df.drop(columns=["param_version_end"])


SIDE_BY_SIDE_COLUMNS = [
    "prompt_id",
    "prompt_text",
    "ground_truth",
    "response_text",
    "reward",
    "advantage",
    "param_version",
    "param_version_end",
    "consumed_version",
    "consumed_step",
]


def side_by_side(run_dir: str | Path, prompts: int = 2, step: int | None = None) -> pd.DataFrame:
    """The responses of a few prompts trained at `step` (default: the last step), each group together."""
    trained = read_trained(run_dir, SIDE_BY_SIDE_COLUMNS)
    if step is None:
        step = pc.max(trained["consumed_step"]).as_py()
    at_step = trained.filter(pc.equal(trained["consumed_step"], step))
    if at_step.num_rows == 0:
        last = pc.max(trained["consumed_step"]).as_py()
        raise ValueError(f"no response was trained at step {step} in {run_dir}; its steps run from 1 to {last}")
    chosen = sorted(set(at_step["prompt_id"].to_pylist()))[:prompts]
    rows = at_step.filter(pc.is_in(at_step["prompt_id"], pa.array(chosen)))
    df = rows.select(["sample_id", *SIDE_BY_SIDE_COLUMNS]).to_pandas()
    return df.sort_values(["prompt_id", "sample_id"], ignore_index=True)
