"""The audit's rules on what a run derived from its samples, recomputed from the logs: each sample's advantage from
its group's rewards (with the run's estimator), and each step's row of metrics.jsonl from the samples it trained.

Advantages are recomputed by the run's own estimator class on the logged rewards: this proves that the logged
advantages belong to the logged rewards of whole groups (a group scored without one of its responses, or a reward
changed after the fact, shows), while the estimators' formulas are proved against verl's in tests/unit.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
from omegaconf import DictConfig, OmegaConf

from pipeline.config import ConfigError
from pipeline.config.targets import advantage_wiring, bind, stage_class
from pipeline.observe.audit_check import Check, examples
from stages.advantage import ESTIMATORS
from stages.reward_sources import LEFT_OUT

ADVANTAGE_TOL = 1e-5  # float32 advantages of the same inputs by the same code: equal but for the float32 rounding
METRIC_TOL = 1e-6
GROUPS_PER_CALL = 256  # the estimator pads a call's rows to its longest response


def estimator(cfg: DictConfig):
    """The run's advantage stage, built from its config.yaml as the wiring builds it."""
    alg = cfg.algorithm
    spec = {"_target_": ESTIMATORS.get(alg.adv_estimator, ""), **OmegaConf.to_container(cfg.stages.advantage)}
    cls, extra = stage_class(spec, "stages.advantage")
    return cls(**bind(cls, "stages.advantage", advantage_wiring(cfg, cls), extra))


def advantages_match(samples: pa.Table, cfg: DictConfig) -> Check:
    """Every whole group's logged advantages (and token advantages, before any whitening over a step) equal what
    the run's estimator makes of its logged rewards."""
    name = "advantages recomputed from the rewards"
    try:
        stage = estimator(cfg)
    except ConfigError as err:
        return Check(name, True, f"not recomputed: {err}", skipped=True)
    inputs = ("prompt_id", "reward", "response_mask", "response_logprobs", "ref_logprobs", "reward_status")
    rows: dict[str, list[int]] = defaultdict(list)
    for i, pid in enumerate(samples["prompt_id"].to_pylist()):
        rows[pid].append(i)
    whole = [idx for idx in rows.values() if len(idx) == stage.group_size]
    bad, worst, checked = [], 0.0, 0
    for start in range(0, len(whole), GROUPS_PER_CALL):
        take = pa.array([i for idx in whole[start : start + GROUPS_PER_CALL] for i in idx], pa.int64())
        logged = samples.take(take)
        again = stage(logged.select([c for c in inputs if c in logged.column_names]))
        for sid, a, b, ta, tb in zip(
            logged["sample_id"].to_pylist(),
            logged["advantage"].to_pylist(),
            again["advantage"].to_pylist(),
            logged["token_advantages"].to_pylist(),
            again["token_advantages"].to_pylist(),
            strict=True,
        ):
            checked += 1
            gap = _gap(a, b, ta, tb)
            worst = max(worst, gap)
            if gap > ADVANTAGE_TOL:
                bad.append(f"{sid} (advantage {a} logged, {b:.6g} recomputed)")
    return Check(
        name,
        not bad,
        f"{type(stage).__name__} over {checked} samples of whole groups, largest gap {worst:.2g} "
        f"(tolerance {ADVANTAGE_TOL:g}); {len(bad)} differ{examples(bad)}",
    )


def _gap(a: float | None, b: float, ta: list | None, tb: list) -> float:
    """The largest absolute difference between a logged advantage (and its tokens') and the recomputed one."""
    if a is None or ta is None or len(ta) != len(tb):
        return math.inf
    return max([abs(a - b), *(abs(x - y) for x, y in zip(ta, tb, strict=True))])


def step_values(rows: list[dict[str, Any]], consumed_version: int) -> dict[str, float]:
    """A step's metrics as pipeline.observe.metrics.step_metrics derives them from the step's samples."""
    lags = np.asarray([consumed_version - r["param_version"] for r in rows])
    lengths = np.asarray([r["num_tokens"] for r in rows])
    # the loss's samples only: a masked or dropped sample's reward is its scorer's failure, not the policy's score
    scored = [r["reward"] for r in rows if r.get("reward_status") not in LEFT_OUT]
    return {
        "reward/mean": float(np.mean(scored)) if scored else math.nan,
        "reward/error_ratio": float(np.mean([r["reward_error"] is not None for r in rows])),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(np.mean([r["finish_reason"] == "length" for r in rows])),
        "staleness/max_lag": float(lags.max()),
        "staleness/mean_lag": float(lags.mean()),
        "trainer/version": float(consumed_version),
    }


def _same(logged: float, want: float) -> bool:
    close = math.isclose(logged, want, rel_tol=METRIC_TOL, abs_tol=METRIC_TOL)
    return close or (math.isnan(logged) and math.isnan(want))


def metrics_match(metrics: list[dict[str, Any]], consumed: pa.Table, samples: pa.Table, by_id: dict[str, int]) -> Check:
    """metrics.jsonl has one row per trained step, and each row's sample-derived values (reward, lengths, lags,
    version) are what the step's consumed samples give."""
    name = "metrics.jsonl agrees with the logs"
    columns = ("reward", "reward_error", "num_tokens", "finish_reason", "param_version", "reward_status")
    columns = tuple(c for c in columns if c in samples.column_names)  # reward_status: runs with reward sources
    values = {c: samples[c].to_pylist() for c in columns}
    steps: dict[int, list[dict[str, Any]]] = defaultdict(list)
    version: dict[int, int] = {}
    for sid, step, at in zip(
        consumed["sample_id"].to_pylist(),
        consumed["consumed_step"].to_pylist(),
        consumed["consumed_version"].to_pylist(),
        strict=True,
    ):
        version[step] = at
        if sid in by_id:
            steps[step].append({c: values[c][by_id[sid]] for c in columns})
    logged = Counter(int(r["step"]) for r in metrics)
    bad = [f"step {s} trained, not logged" for s in sorted(set(version) - set(logged))]
    bad += [f"step {s} logged {n} times" for s, n in sorted(logged.items()) if n > 1]
    bad += [f"step {s} logged, not trained" for s in sorted(set(logged) - set(version))]
    for row in metrics:
        step = int(row["step"])
        if not steps.get(step):
            continue
        for key, want in step_values(steps[step], version[step]).items():
            if key in row and not _same(row[key], want):
                bad.append(f"step {step} {key} (logged {row[key]:.6g}, the logs give {want:.6g})")
    return Check(name, not bad, f"{len(metrics)} rows; {len(bad)} disagree{examples(bad)}")
