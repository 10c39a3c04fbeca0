"""Per-step metrics of a trained batch: rewards, lengths, lags, the gate's counters and verl's fully_async/* counts."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from pipeline.observe.reward_metrics import reward_source_metrics, trained_reward_mean
from pipeline.observe.rollout_status import step_timings


class FullyAsyncCounters:
    """verl's fully_async/* metrics: stale counts over the whole run, partial-rollout counts per sync window."""

    def __init__(self) -> None:
        self.stale_samples = 0  # prompts (groups) with at least one stale trajectory, cumulative
        self.stale_trajectories = 0
        self.new_window()

    def new_window(self) -> None:
        """Called at each sync: verl reports partial counts between two syncs."""
        self.window_trajectories = 0
        self.partial = 0
        self.max_span = 0

    def update(self, table, version: int) -> dict[str, float]:
        lags = version - np.asarray(table["param_version"].to_pylist())
        spans = np.asarray(table["param_version_end"].to_pylist()) - np.asarray(table["param_version"].to_pylist())
        stale_prompts = {pid for pid, lag in zip(table["prompt_id"].to_pylist(), lags, strict=True) if lag > 0}
        self.stale_samples += len(stale_prompts)
        self.stale_trajectories += int((lags > 0).sum())
        self.window_trajectories += len(spans)
        self.partial += int((spans > 0).sum())
        self.max_span = max(self.max_span, int(spans.max(initial=0)))
        return {
            "fully_async/count/stale_samples_processed": float(self.stale_samples),
            "fully_async/count/stale_trajectory_processed": float(self.stale_trajectories),
            "fully_async/partial/total_partial_num": float(self.partial),
            "fully_async/partial/partial_ratio": self.partial / max(self.window_trajectories, 1),
            "fully_async/partial/max_partial_span": float(self.max_span),
        }


def reward_kl_metrics(table, kl_coef: float) -> dict[str, float]:
    """verl's metrics of the KL in the reward, when the step's samples carry `reward_kl`: the mean over samples of
    each sample's masked mean token KL, and the (fixed) coefficient."""
    if "reward_kl" not in table.column_names:
        return {}
    values = [v for v in table["reward_kl"].to_pylist() if v is not None]
    if not values:
        return {}
    return {"actor/reward_kl_penalty": float(np.mean(values)), "actor/reward_kl_penalty_coeff": float(kl_coef)}


def reward_extra_metrics(table) -> dict[str, float]:
    """The mean over the step's samples of each number (or bool) in their reward_extra_info: the reward manager's
    `acc`, the dapo manager's `overlong` (the share that paid) and `overlong_reward`, a custom function's own keys;
    `reward_extra/<key>/mean`, each over the samples that have the key."""
    if "reward_extra_info" not in table.column_names:
        return {}
    values: dict[str, list[float]] = {}
    for text in table["reward_extra_info"].to_pylist():
        for key, value in (json.loads(text) if text else {}).items():
            if isinstance(value, bool | int | float) and math.isfinite(value):
                values.setdefault(key, []).append(float(value))
    return {f"reward_extra/{key}/mean": float(np.mean(v)) for key, v in sorted(values.items())}


def step_metrics(
    batch, version: int, clock_stats: dict[str, Any], train_s: float, kl_coef: float = 0.0
) -> dict[str, float]:
    table = batch.table
    lags = version - np.asarray(table["param_version"].to_pylist())
    lengths = np.asarray(table["num_tokens"].to_pylist())
    return (
        reward_kl_metrics(table, kl_coef)
        | reward_extra_metrics(table)
        | reward_source_metrics(table)
        | {
            "reward/mean": trained_reward_mean(table),
            "reward/error_ratio": float(np.mean([e is not None for e in table["reward_error"].to_pylist()])),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": float(np.mean([r == "length" for r in table["finish_reason"].to_pylist()])),
            "staleness/max_lag": float(lags.max()),
            "staleness/mean_lag": float(lags.mean()),
            "trainer/wait_s": batch.wait_s,
            "trainer/idle_ratio": batch.wait_s / max(batch.wait_s + train_s, 1e-9),
            "trainer/version": float(version),
            # The step's samples, and the part of them that crossed the driver (the rest went store -> trainer).
            "perf/step_bytes": float(batch.driver_bytes + batch.heavy_bytes),
            "perf/driver_bytes": float(batch.driver_bytes),
            "gate/admitted_total": float(clock_stats["admitted_total"]),
            "gate/outstanding": float(clock_stats["outstanding"]),
            "gate/in_flight": float(clock_stats["in_flight"]),  # verl's monitor/active_tasks_size
            "gate/blocked_s": float(clock_stats["gate_blocked_s"]),
            "fully_async/total_wait_time": batch.wait_s,  # verl's names of the trainer's wait and version
            "fully_async/count/current_param_version": float(version),
        }
        | clock_stats.get("rollout_status", {})
        | step_timings(table)
        | filter_metrics(batch, clock_stats)
    )


def filter_metrics(batch, clock_stats: dict[str, Any]) -> dict[str, float]:
    """Dynamic sampling's account of the step (nothing when it is off): the groups it left out while the step filled,
    the groups trained, and groups generated per group trained; under verl's V1 name too, which counts groups. With
    reward.on_error=drop_group, the dropped groups left out (and refilled) while it filled."""
    dropped = batch.dropped_groups
    refill = {} if dropped is None else {"reward/dropped_groups_refilled": float(dropped)}
    filtered = batch.filtered_groups
    if filtered is None:
        return refill
    kept = len(batch.groups)
    return refill | {
        "filter_groups/filtered_groups": float(filtered),
        "filter_groups/kept_groups": float(kept),
        "filter_groups/generated_per_trained": (filtered + kept) / kept,
        "filter_groups/filtered_total": float(clock_stats.get("filtered_total", 0)),
        "training/filter_groups/evicted_samples": float(filtered),
    }
