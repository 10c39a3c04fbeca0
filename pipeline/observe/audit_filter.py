"""The audit's rule on dynamic sampling (algorithm.filter_groups, stages/group_filter.py), from the filter log.

Every filtered group is whole (all `rollout.n` responses, each in the sample log), none of its samples was trained,
and the filter metric recomputed from the sample log has the one value the log records for every response; and, while
the filter was on, every trained group's metric varies (a group the filter should have left out was not trained).
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
from omegaconf import DictConfig

from pipeline.observe.audit_check import Check, examples
from stages.group_filter import GroupFilter


def filtered_at(filtered: pa.Table | None) -> dict[str, int]:
    """prompt_id -> the clock's version when its group was filtered."""
    if filtered is None:
        return {}
    return dict(zip(filtered["prompt_id"].to_pylist(), filtered["filtered_version"].to_pylist(), strict=True))


def filtered_groups(filtered: pa.Table | None, consumed: pa.Table, samples: pa.Table, cfg: DictConfig) -> Check:
    name = "filtered groups carry no signal, trained ones do"
    fg = cfg.algorithm.get("filter_groups", {})
    if not fg.get("enable", False) or not fg.get("metric"):
        rows = 0 if filtered is None else filtered.num_rows
        return Check(name, False, f"{rows} samples filtered by a run whose algorithm.filter_groups is off")
    group_filter, n = GroupFilter(str(fg["metric"])), int(cfg.rollout.n)
    by_prompt = _groups(samples)
    bad: list[str] = []
    logged: dict[str, list[tuple[str, float]]] = defaultdict(list)
    if filtered is not None:
        for sid, pid, value in zip(
            *(filtered[c].to_pylist() for c in ("sample_id", "prompt_id", "filtered_value")), strict=True
        ):
            logged[pid].append((sid, value))
    trained = set(consumed["sample_id"].to_pylist())
    for pid, rows in logged.items():
        group = by_prompt.get(pid)
        ids = {sid for sid, _ in rows}
        if len(rows) != n or len(ids) != n or group is None or set(group["sample_id"].to_pylist()) != ids:
            bad.append(f"{pid} (filtered {len(rows)} rows, not its whole group of {n} in the sample log)")
        elif ids & trained:
            bad.append(f"{pid} (filtered and trained)")
        elif {v for _, v in rows} != {group_filter.shared_value(group)}:
            bad.append(f"{pid} (filtered at {rows[0][1]}, its metric {group_filter.values(group)})")
    signal = [pid for pid in set(consumed["prompt_id"].to_pylist()) if pid in by_prompt]
    flat = sorted(pid for pid in signal if group_filter.shared_value(by_prompt[pid]) is not None)
    bad += [f"{pid} (trained, its {group_filter.metric} the same for every response)" for pid in flat]
    return Check(
        name,
        not bad,
        f"{len(logged)} groups filtered on {group_filter.metric}, {len(signal)} trained; {len(bad)} wrong"
        f"{examples(bad)}",
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
