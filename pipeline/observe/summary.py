"""A finished run's summary, computed from its logs (metrics.jsonl, validation/metrics.jsonl) and its audit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np


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
        **_filtered(run_dir),
    }


def _filtered(run_dir: Path) -> dict[str, Any]:
    """The groups the sink left out and refilled (the filter log), by why: dynamic sampling's flat ones
    (groups_filtered) and the ones reward.on_error=drop_group dropped (groups_dropped), if there were any."""
    path = run_dir / "filtered"
    if not path.is_dir():
        return {}
    import pyarrow.dataset as pds

    table = pds.dataset(str(path), format="parquet").to_table()
    reasons = table["filtered_reason"].to_pylist() if "filtered_reason" in table.column_names else None
    by_reason: dict[str, set] = {"flat": set(), "reward_failed": set()}
    for i, pid in enumerate(table["prompt_id"].to_pylist()):
        by_reason.setdefault(reasons[i] if reasons else "flat", set()).add(pid)
    out = {"groups_filtered": len(by_reason["flat"])}
    return out | ({"groups_dropped": len(by_reason["reward_failed"])} if by_reason["reward_failed"] else {})


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


def format_summary(s: dict[str, Any], report) -> str:
    return "\n".join(
        [
            "",
            "== asyncrl run summary ==",
            f"steps {s['steps']}, samples consumed {s['samples_consumed']}, prompts admitted {s['prompts_admitted']} "
            f"({s['prompts_in_flight_at_end']} still in flight at the end"
            + (f", {s['groups_filtered']} groups filtered by dynamic sampling" if s.get("groups_filtered") else "")
            + (f", {s['groups_dropped']} dropped groups refilled" if s.get("groups_dropped") else "")
            + ")",
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
