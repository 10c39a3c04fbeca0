"""Per-step metrics of the reward sources, from a step's reward_sources and reward_status columns
(stages/reward_sources.py):

- `reward/<source>/share`: the share of the step's samples the source scored (a failure is not a score);
- `reward/<source>/error_ratio`: the share of the samples it worked on that it failed;
- `reward/<source>/retries`: calls beyond the first, summed over the step's samples;
- `reward/<source>/latency_s`, `reward/<source>/latency_max_s`: the mean and the largest of its samples' latency_s;
- `reward/status/<status>_ratio`: the share of the step's samples that were scored ('ok'), trained with reward 0
  ('zero'), masked or dropped (reward.on_error). The statuses cover every sample: the ratios sum to 1.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

STATUSES = ("ok", "zero", "masked", "dropped")


def reward_source_metrics(table) -> dict[str, float]:
    """The metrics above for a step's table; empty when the reward step did not run (hand-built tables)."""
    if "reward_sources" not in table.column_names:
        return {}
    rows = table["reward_sources"].to_pylist()
    by_source: dict[str, list[dict]] = defaultdict(list)
    for entries in rows:
        for name, rec in entries or []:
            by_source[name].append(rec)
    out: dict[str, float] = {}
    for name, recs in sorted(by_source.items()):
        failed = [r["error"] is not None for r in recs]
        latency = np.array([r["latency_s"] for r in recs], np.float64)
        out |= {
            f"reward/{name}/share": (len(recs) - sum(failed)) / len(rows),
            f"reward/{name}/error_ratio": float(np.mean(failed)),
            f"reward/{name}/retries": float(sum(r["attempts"] - 1 for r in recs)),
            f"reward/{name}/latency_s": float(latency.mean()),
            f"reward/{name}/latency_max_s": float(latency.max()),
        }
    if "reward_status" in table.column_names:
        status = table["reward_status"].to_pylist()
        out |= {f"reward/status/{s}_ratio": status.count(s) / len(status) for s in STATUSES}
    return out


def trained_reward_mean(table) -> float:
    """The mean reward of the samples the loss sees: a masked or dropped sample's reward (0 for a failure) is not a
    score of the policy, and would pull the curve down with the scorer's failures."""
    rewards = np.asarray(table["reward"].to_pylist(), np.float64)
    if "reward_status" not in table.column_names:
        return float(rewards.mean())
    kept = np.array([s not in ("masked", "dropped") for s in table["reward_status"].to_pylist()], bool)
    return float(rewards[kept].mean()) if kept.any() else float("nan")
