"""The audit's rule on the groups the sink left out and refilled, from the filter log: dynamic sampling's flat
groups (algorithm.filter_groups, stages/group_filter.py) and the groups reward.on_error=drop_group dropped.

Every left-out group is whole (all `rollout.n` responses, each in the sample log) and none of its samples was trained.
A flat one was left out by a run whose filter is on, and the filter metric recomputed from the sample log has the one
value the log records for every response; while the filter was on, every trained group's metric varies. A dropped one
was left out by a run under drop_group and holds a sample whose reward status is 'dropped'; under drop_group no
trained group holds one (it should have been refilled).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pyarrow as pa
from omegaconf import DictConfig

from pipeline.observe.audit_check import Check, examples
from stages.group_filter import GroupFilter
from stages.reward_sources import DROPPED
from stages.sink import DROPPED_REASON, FLAT_REASON


def filtered_at(filtered: pa.Table | None) -> dict[str, int]:
    """prompt_id -> the clock's version when its group was filtered."""
    if filtered is None:
        return {}
    return dict(zip(filtered["prompt_id"].to_pylist(), filtered["filtered_version"].to_pylist(), strict=True))


def filtered_groups(filtered: pa.Table | None, consumed: pa.Table, samples: pa.Table, cfg: DictConfig) -> Check:
    name = "left-out groups whole and never trained, flat ones flat, dropped ones failed"
    fg = cfg.algorithm.get("filter_groups", {})
    flat_on = bool(fg.get("enable", False) and fg.get("metric"))
    drop_on = cfg.get("reward", {}).get("on_error") == "drop_group"
    group_filter = GroupFilter(str(fg["metric"])) if flat_on else None
    n, by_prompt, trained = int(cfg.rollout.n), _groups(samples), set(consumed["sample_id"].to_pylist())
    logged: dict[str, list[tuple[str, float | None, str]]] = defaultdict(list)
    if filtered is not None:
        reasons = filtered["filtered_reason"].to_pylist() if "filtered_reason" in filtered.column_names else None
        columns = [filtered[c].to_pylist() for c in ("sample_id", "prompt_id", "filtered_value")]
        for i, (sid, pid, value) in enumerate(zip(*columns, strict=True)):
            logged[pid].append((sid, value, reasons[i] if reasons else FLAT_REASON))
    bad: list[str] = []
    for pid, rows in logged.items():
        group, ids, reason = by_prompt.get(pid), {sid for sid, _, _ in rows}, rows[0][2]
        if len(rows) != n or len(ids) != n or group is None or set(group["sample_id"].to_pylist()) != ids:
            bad.append(f"{pid} (left out {len(rows)} rows, not its whole group of {n} in the sample log)")
        elif ids & trained:
            bad.append(f"{pid} (left out and trained)")
        elif reason == DROPPED_REASON:
            statuses = group["reward_status"].to_pylist() if "reward_status" in group.column_names else []
            if not drop_on:
                bad.append(f"{pid} (dropped for a failed reward by a run whose reward.on_error is not drop_group)")
            elif DROPPED not in statuses:
                bad.append(f"{pid} (dropped for a failed reward, its samples' statuses {sorted(set(statuses))})")
        elif reason != FLAT_REASON or group_filter is None:
            bad.append(f"{pid} (filtered as {reason!r} by a run whose algorithm.filter_groups is off)")
        elif {v for _, v, _ in rows} != {group_filter.shared_value(group)}:
            bad.append(f"{pid} (filtered at {rows[0][1]}, its metric {group_filter.values(group)})")
    signal = [pid for pid in set(consumed["prompt_id"].to_pylist()) if pid in by_prompt]
    if group_filter is not None:
        flat = sorted(pid for pid in signal if group_filter.shared_value(by_prompt[pid]) is not None)
        bad += [f"{pid} (trained, its {group_filter.metric} the same for every response)" for pid in flat]
    if drop_on and "reward_status" in samples.column_names:
        failed = sorted(pid for pid in signal if DROPPED in by_prompt[pid].column("reward_status").to_pylist())
        bad += [f"{pid} (trained, a group the reward step dropped: it should have been refilled)" for pid in failed]
    counts = Counter(rows[0][2] for rows in logged.values())
    return Check(
        name,
        not bad,
        f"{counts[FLAT_REASON]} groups filtered as flat"
        + (f" on {group_filter.metric}" if group_filter else "")
        + f", {counts[DROPPED_REASON]} dropped for a failed reward and refilled, {len(signal)} trained; "
        f"{len(bad)} wrong{examples(bad)}",
    )


def _groups(samples: pa.Table) -> dict[str, pa.Table]:
    """The sample log's groups, by prompt, with the columns the filter reads."""
    wanted = ("prompt_id", "sample_id", "reward", "reward_status", "reward_extra_info")
    columns = [c for c in wanted if c in samples.column_names]
    rows = samples.select(columns).to_pylist()
    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_prompt[row["prompt_id"]].append(row)
    return {pid: pa.Table.from_pylist(group) for pid, group in by_prompt.items()}
