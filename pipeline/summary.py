"""Per-step metrics from a trained batch, and the end of a run: ledgers to disk, audit, printed summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.audit import audit
from pipeline.stream import wait_for_executors
from schemas import ADMITTED_SCHEMA


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


def step_metrics(batch, version: int, clock_stats: dict[str, Any], train_s: float) -> dict[str, float]:
    table = batch.table
    lags = version - np.asarray(table["param_version"].to_pylist())
    lengths = np.asarray(table["num_tokens"].to_pylist())
    return {
        "reward/mean": float(np.mean(table["reward"].to_pylist())),
        "reward/error_ratio": float(np.mean([e is not None for e in table["reward_error"].to_pylist()])),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/clip_ratio": float(np.mean([r == "length" for r in table["finish_reason"].to_pylist()])),
        "staleness/max_lag": float(lags.max()),
        "staleness/mean_lag": float(lags.mean()),
        "trainer/wait_s": batch.wait_s,
        "trainer/idle_ratio": batch.wait_s / max(batch.wait_s + train_s, 1e-9),
        "trainer/version": float(version),
        "gate/admitted_total": float(clock_stats["admitted_total"]),
        "gate/outstanding": float(clock_stats["outstanding"]),
        "gate/blocked_s": float(clock_stats["gate_blocked_s"]),
    }


def _read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summarize(run_dir: Path, report) -> dict[str, Any]:
    rows = _read_metrics(run_dir)
    rewards = [r["reward/mean"] for r in rows]
    tenth = max(1, len(rewards) // 10)
    syncs = [r["sync/trainer_blocked_s"] for r in rows if "sync/trainer_blocked_s" in r]  # push and pull
    rollouter_idle = [r["rollouter/idle_ratio"] for r in rows if "rollouter/idle_ratio" in r]
    waits = sum(r["trainer/wait_s"] for r in rows)
    trains = sum(r["timing/train_s"] for r in rows)
    return {
        "run_dir": str(run_dir),
        "steps": len(rows),
        "samples_consumed": report.consumed_samples,
        "prompts_admitted": report.admitted_prompts,
        "prompts_in_flight_at_end": report.unconsumed_prompts,
        "reward_first": float(np.mean(rewards[:tenth])) if rewards else float("nan"),
        "reward_last": float(np.mean(rewards[-tenth:])) if rewards else float("nan"),
        "max_lag": report.max_lag,
        "lag_bound": report.lag_bound,
        "syncs": len(syncs),
        "sync_mean_s": float(np.mean(syncs)) if syncs else 0.0,
        "trainer_idle_ratio": waits / max(waits + trains, 1e-9),
        "rollouter_idle_ratio": float(np.mean(rollouter_idle)) if rollouter_idle else float("nan"),  # per sync window
        "wall_s": rows[-1]["timing/elapsed_s"] if rows else 0.0,
        "audit_ok": report.ok,
        **_validation(run_dir),
    }


def _validation(run_dir: Path) -> dict[str, Any]:
    """The first and last validation passes' mean reward (of the first data source), if the run validated."""
    path = run_dir / "validation" / "metrics.jsonl"
    passes = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not passes:
        return {}
    key = next(k for k in sorted(passes[0]) if "/mean@" in k)
    return {
        "val_metric": key,
        "val_versions": [int(p["val/version"]) for p in passes],
        "val_first": passes[0][key],
        "val_last": passes[-1].get(key, float("nan")),
    }


def finish_run(ctx, clock, sink) -> dict[str, Any]:
    """Write the gate's ledger, stop the stream, audit the logs, print the summary and hand the audit and summary
    to the monitor, which then ends the run as finished. Ray is stopped last, by the caller: the shorter the time
    between ray.shutdown() and the end of the process, the less a stray library thread can run into it."""
    ray.get(clock.close.remote())
    admissions = ray.get(clock.admissions.remote())
    pq.write_table(
        pa.table(
            {
                "prompt_id": [a[0] for a in admissions],
                "admitted_version": [a[1] for a in admissions],
                "admitted_time": [a[2] for a in admissions],
            },
            schema=ADMITTED_SCHEMA,
        ),
        ctx.run_dir / "admitted.parquet",
    )
    outstanding = ray.get(clock.stats.remote())["outstanding"]
    sink.close()
    wait_for_executors()  # before ray.shutdown(): see there
    report = audit(ctx.run_dir)
    (ctx.run_dir / "audit.txt").write_text(report.table() + "\n")
    summary = summarize(ctx.run_dir, report)
    summary["prompts_outstanding_in_clock"] = outstanding
    summary["prompts_buffered_unconsumed"] = len(sink.leftover())
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary, report), flush=True)
    ctx.monitor.log_artifacts([ctx.run_dir / "summary.json", ctx.run_dir / "audit.txt"])
    ctx.monitor.close(ok=True)
    return summary


def format_summary(s: dict[str, Any], report) -> str:
    return "\n".join(
        [
            "",
            "== asyncrl run summary ==",
            f"steps {s['steps']}, samples consumed {s['samples_consumed']}, prompts admitted {s['prompts_admitted']} "
            f"({s['prompts_in_flight_at_end']} still in flight at the end)",
            f"reward {s['reward_first']:.3f} (first 10% of steps) -> {s['reward_last']:.3f} (last 10%)",
            f"max lag {s['max_lag']} (bound {s['lag_bound']}), syncs {s['syncs']}, "
            f"trainer blocked {s['sync_mean_s']:.3f}s per sync, trainer idle {s['trainer_idle_ratio']:.2f}, "
            f"rollouter idle {s['rollouter_idle_ratio']:.2f}, "
            f"wall {s['wall_s']:.0f}s",
            *(
                [
                    f"{s['val_metric']} {s['val_first']:.3f} (version {s['val_versions'][0]}) -> {s['val_last']:.3f} "
                    f"(version {s['val_versions'][-1]}), {len(s['val_versions'])} validation passes"
                ]
                if "val_metric" in s
                else []
            ),
            report.table(),
            f"audit: {'PASS' if report.ok else 'FAIL'}  ({s['run_dir']})",
        ]
    )
