"""Audit a run from its logs alone: staleness bound, admission windows, token versions, exactly-once consumption of
whole groups, advantages and logged metrics recomputed, MoE route rows, reward failures.

Reads `<run>/samples` (every generated sample), `<run>/consumed` (what the trainer trained on, at which version),
`<run>/admitted.parquet` (the gate's ledger), `<run>/config.yaml` (the bound, the group size, the estimator),
`<run>/metrics.jsonl` (what the run reported per step) and the model's config.json (for the width of a route row).
Nothing here trusts the process that produced the run: the verdict is recomputed from what is on disk. A failing
check names its rule and the first samples (or step, or version) that break it.

The rules on single samples' token columns are in audit_tokens.py; those that recompute what the run derived
(advantages, metrics) in audit_derived.py.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
from omegaconf import DictConfig, OmegaConf

from pipeline.observe.audit_check import Check, examples
from pipeline.observe.audit_derived import advantages_match, metrics_match
from pipeline.observe.audit_filter import filtered_at, filtered_groups
from pipeline.observe.audit_tokens import (
    no_token_older_than_admission,
    per_token_columns,
    route_rows,
    route_width,
    versions_never_decrease,
)
from pipeline.observe.reward_audit import reward_failures
from stages.staleness import StalenessBudget

__all__ = ["AuditReport", "Check", "RunDirError", "audit", "budget_of", "read_dir", "route_width"]


class RunDirError(FileNotFoundError):
    """The directory is not a finished run's: the message names what is missing and why it would be there."""


# What a finished run leaves and the audit reads: (path, what writes it).
REQUIRED = (
    ("config.yaml", "the run's resolved config, written at its start"),
    (
        "admitted.parquet",
        "the gate's ledger, written when the run finishes; a run that was killed or is still "
        "running has none: resume it with resume=true, or audit it once it has finished",
    ),
)


@dataclass
class AuditReport:
    checks: list[Check] = field(default_factory=list)
    max_lag: int = 0
    lag_bound: int = 0
    consumed_samples: int = 0
    admitted_prompts: int = 0
    unconsumed_prompts: int = 0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        """The check of that rule (KeyError naming the rules there are, if none)."""
        found = [c for c in self.checks if c.name == name]
        if not found:
            raise KeyError(f"no check {name!r}; the report has {[c.name for c in self.checks]}")
        return found[0]

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"{'check':<{width}}  result  detail"]
        lines += [f"{c.name:<{width}}  {c.result:<6}  {c.detail}" for c in self.checks]
        return "\n".join(lines)


@dataclass
class RunLogs:
    """A run's logs as the audit reads them; samples and consumed are None when the run logged none."""

    run_dir: Path
    cfg: DictConfig
    samples: pa.Table | None
    consumed: pa.Table | None
    admitted: pa.Table
    metrics: list[dict[str, Any]]
    filtered: pa.Table | None = None  # groups dynamic sampling left out (None: none, or it was off)


def read_dir(path: Path) -> pa.Table | None:
    """Every Parquet shard under `path` as one table; None when there is none (pyarrow skips the `_`-named files a
    writer killed mid-shard leaves)."""
    if not path.is_dir():
        return None
    table = pds.dataset(str(path), format="parquet").to_table()
    return table if table.num_rows else None


def budget_of(run_dir: Path) -> StalenessBudget:
    return StalenessBudget.from_config(OmegaConf.load(Path(run_dir) / "config.yaml"))


def read_run(run_dir: str | Path) -> RunLogs:
    """The run's logs; RunDirError naming the first missing one if `run_dir` is not a finished run's directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir} is not a directory: give the run directory (<trainer.output_dir>/<run_name>)")
    for name, what in REQUIRED:
        if not (run_dir / name).is_file():
            raise RunDirError(f"{run_dir} has no {name} ({what})")
    metrics_path = run_dir / "metrics.jsonl"
    lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
    return RunLogs(
        run_dir,
        OmegaConf.load(run_dir / "config.yaml"),
        read_dir(run_dir / "samples"),
        read_dir(run_dir / "consumed"),
        pq.read_table(run_dir / "admitted.parquet"),
        [json.loads(line) for line in lines if line.strip()],
        read_dir(run_dir / "filtered"),
    )


def audit(run_dir: str | Path) -> AuditReport:
    logs = read_run(run_dir)
    budget = StalenessBudget.from_config(logs.cfg)
    report = AuditReport(lag_bound=budget.lag_bound, admitted_prompts=logs.admitted.num_rows)
    samples, consumed = logs.samples, logs.consumed
    if samples is None or consumed is None:
        report.checks.append(Check("logs present", False, f"no samples or no consumption log in {logs.run_dir}"))
        return report
    report.consumed_samples = consumed.num_rows
    by_id = {sid: i for i, sid in enumerate(samples["sample_id"].to_pylist())}
    group_size = int(logs.cfg.rollout.n)
    report.checks += [
        _logged_once(samples),
        _consumed_in_sample_log(consumed, by_id),
        _whole_groups(consumed, group_size),
        _lag(consumed, samples, by_id, budget.lag_bound, report),
        _partial_span(consumed, samples, by_id, budget.lag_bound),
        versions_never_decrease(samples),
        no_token_older_than_admission(samples, logs.admitted),
        per_token_columns(samples),
        _exactly_once(consumed),
        _admissions(logs.admitted, consumed, samples, report, filtered_at(logs.filtered)),
        _windows(logs.admitted, consumed, budget, filtered_at(logs.filtered)),
        _concurrency(logs.admitted, samples, budget),
        advantages_match(samples, logs.cfg),
        metrics_match(logs.metrics, consumed, samples, by_id),
    ]
    if "routed_experts" in samples.column_names and samples["routed_experts"].null_count < samples.num_rows:
        report.checks.append(route_rows(samples, route_width(logs.run_dir)))
    refilled = logs.cfg.get("reward", {}).get("on_error") == "drop_group"
    if logs.filtered is not None or refilled or logs.cfg.algorithm.get("filter_groups", {}).get("enable", False):
        report.checks.append(filtered_groups(logs.filtered, consumed, samples, logs.cfg))
    failures = reward_failures(samples)
    if failures is not None:
        report.checks.append(Check("every failed reward accounted for", *failures))
    return report


def _logged_once(samples: pa.Table) -> Check:
    counts = Counter(samples["sample_id"].to_pylist())
    twice = [sid for sid, n in counts.items() if n > 1]
    return Check(
        "every sample logged once",
        not twice,
        f"{len(twice)} of {len(counts)} sample ids logged more than once{examples(twice)}",
    )


def _consumed_in_sample_log(consumed: pa.Table, by_id: dict[str, int]) -> Check:
    ids = consumed["sample_id"].to_pylist()
    missing = [sid for sid in ids if sid not in by_id]
    return Check(
        "every consumed sample is in the sample log",
        not missing,
        f"{len(ids) - len(missing)}/{len(ids)} found{examples(missing, 'missing')}",
    )


def _whole_groups(consumed: pa.Table, group_size: int) -> Check:
    """Each consumed prompt trained on exactly its rollout.n responses, `<prompt_id>/0` .. `/<n-1>`: a group that
    lost a response (or gained one) would have skewed its advantages and the step's size."""
    trained: dict[str, list[str]] = defaultdict(list)
    for sid, pid in zip(consumed["sample_id"].to_pylist(), consumed["prompt_id"].to_pylist(), strict=True):
        trained[pid].append(sid)
    bad = []
    for pid, sids in trained.items():
        want = {f"{pid}/{i}" for i in range(group_size)}
        if sorted(sids) != sorted(want):
            lost, extra = sorted(want - set(sids)), sorted(set(sids) - want)
            bad.append(f"{pid} ({len(sids)} responses; missing {lost or 'none'}, unexpected {extra or 'none'})")
    return Check(
        f"every consumed group is whole ({group_size} responses)",
        not bad,
        f"{len(bad)} of {len(trained)} consumed prompts violate it{examples(bad)}",
    )


def _versions_of(consumed: pa.Table, samples: pa.Table, by_id: dict[str, int], column: str) -> list[int | None]:
    values = samples[column].to_pylist()
    return [values[by_id[sid]] if sid in by_id else None for sid in consumed["sample_id"].to_pylist()]


def _lag(consumed: pa.Table, samples: pa.Table, by_id: dict[str, int], bound: int, report: AuditReport) -> Check:
    """A sample's lag: the trainer's version when it trained on it minus the oldest version among its tokens."""
    oldest = _versions_of(consumed, samples, by_id, "param_version")
    rows = zip(consumed["sample_id"].to_pylist(), consumed["consumed_version"].to_pylist(), oldest, strict=True)
    lags = [(at - v, sid) for sid, at, v in rows if v is not None]
    report.max_lag = max((lag for lag, _ in lags), default=0)
    over = [f"{sid} (lag {lag})" for lag, sid in sorted(lags, reverse=True) if lag > bound]
    return Check(
        "lag <= bound",
        not over,
        f"max lag {report.max_lag}, bound {bound}; {len(over)} samples over it{examples(over)}",
    )


def _partial_span(consumed: pa.Table, samples: pa.Table, by_id: dict[str, int], bound: int) -> Check:
    first = _versions_of(consumed, samples, by_id, "param_version")
    last = _versions_of(consumed, samples, by_id, "param_version_end")
    ids = consumed["sample_id"].to_pylist()
    spans = [(b - a, sid) for sid, a, b in zip(ids, first, last, strict=True) if a is not None]
    widest = max((s for s, _ in spans), default=0)
    over = [f"{sid} (span {s})" for s, sid in spans if s > bound]
    return Check(
        "partial span <= bound",
        not over,
        f"{sum(s > 0 for s, _ in spans)} trained responses span versions, widest span {widest}, bound {bound}"
        f"{examples(over, 'over')}",
    )


def _exactly_once(consumed: pa.Table) -> Check:
    counts = Counter(consumed["sample_id"].to_pylist())
    twice = [f"{sid} ({n} times)" for sid, n in counts.items() if n > 1]
    return Check(
        "no sample consumed twice", not twice, f"{len(twice)} samples consumed more than once{examples(twice)}"
    )


def _admissions(
    admitted: pa.Table, consumed: pa.Table, samples: pa.Table, report: AuditReport, filtered: dict[str, int]
) -> Check:
    """The ledger admits each prompt once; every prompt trained on, filtered, or generated at all, was admitted; no
    prompt is both trained on and filtered."""
    ledger = admitted["prompt_id"].to_pylist()
    admitted_ids = set(ledger)
    consumed_ids = set(consumed["prompt_id"].to_pylist())
    done = consumed_ids | set(filtered)
    stray = sorted(done - admitted_ids)
    both = sorted(consumed_ids & set(filtered))
    unadmitted = sorted(set(samples["prompt_id"].to_pylist()) - admitted_ids - done)
    twice = sorted(pid for pid, n in Counter(ledger).items() if n > 1)
    report.unconsumed_prompts = len(admitted_ids - done)
    return Check(
        "every admitted prompt consumed or filtered once, or reported in flight",
        not stray and not twice and not unadmitted and not both,
        f"{len(consumed_ids)} consumed, {len(filtered)} filtered{examples(both, 'also trained')}, "
        f"{report.unconsumed_prompts} in flight at the end, "
        f"{len(stray)} done without admission{examples(stray)}, {len(twice)} admitted twice{examples(twice)}, "
        f"{len(unadmitted)} generated without admission{examples(unadmitted)}",
    )


def _windows(admitted: pa.Table, consumed: pa.Table, budget: StalenessBudget, filtered: dict[str, int]) -> Check:
    """verl's rule per version v, the gate's budget: the prompts admitted at v plus those carried over into v
    (admitted earlier and not trained on before v began, i.e. consumed at a version >= v or never), less the prompts
    dynamic sampling filtered during v (each frees its permit), stay within max_required_samples. The trainer
    reports a step's prompts consumed before it syncs, so the gate's count at a sync is at least this one: a window
    over the budget here is one the gate let through."""
    consumed_at = dict(zip(consumed["prompt_id"].to_pylist(), consumed["consumed_version"].to_pylist(), strict=True))
    consumed_at |= filtered  # a filtered prompt is done in the version it was filtered in
    refunds = Counter(filtered.values())
    versions = admitted["admitted_version"].to_pylist()
    in_version = Counter(versions)
    last = max(in_version, default=0)
    # A prompt admitted at a and consumed at c is carried over into every version in (a, c]; never consumed: (a, ..)
    change = [0] * (last + 2)
    for pid, a in zip(admitted["prompt_id"].to_pylist(), versions, strict=True):
        c = min(consumed_at.get(pid, last), last)
        if c > a:
            change[a + 1] += 1
            change[c + 1] -= 1
    carried, over = 0, []
    for v in range(last + 1):
        carried += change[v]
        if in_version[v] + carried - refunds[v] > budget.max_required_samples:
            over.append(f"version {v} ({in_version[v]} admitted + {carried} carried over - {refunds[v]} filtered)")
    return Check(
        "admissions per version within verl's budget",
        not over,
        f"{len(over)} of {len(in_version)} versions over max_required_samples={budget.max_required_samples}"
        f"{examples(over)}",
    )


def _concurrency(admitted: pa.Table, samples: pa.Table, budget: StalenessBudget) -> Check:
    """verl's bound on the prompts generating at once: a prompt is in flight from its admission (the ledger's time)
    until its last response was generated (never, if it has none), and at no moment are more than
    max_concurrent_samples + 1 in flight (stages/staleness.py). The clock frees a prompt's place only once its
    replica has handed the whole call on, after each response's `generated_time`, so these intervals lie inside the
    clock's and a moment over the bound here is one the gate let through. The bound is the run's last config's:
    a resume that changed rollout.num_replicas is checked against the new count."""
    done: dict[str, float] = {}
    for pid, at in zip(samples["prompt_id"].to_pylist(), samples["generated_time"].to_pylist(), strict=True):
        done[pid] = max(done.get(pid, at), at)
    events = []  # (time, +1 admitted / -1 done); at one time the ends first, as the clock frees before it admits
    for pid, at in zip(admitted["prompt_id"].to_pylist(), admitted["admitted_time"].to_pylist(), strict=True):
        events += [(at, 1, pid), (done.get(pid, float("inf")), -1, pid)]
    events.sort(key=lambda e: (e[0], e[1]))
    bound = budget.max_concurrent_samples + 1
    in_flight: set[str] = set()
    widest, over = 0, []
    for _, change, pid in events:
        if change > 0:
            in_flight.add(pid)
        else:
            in_flight.discard(pid)
        widest = max(widest, len(in_flight))
        if len(in_flight) > bound:
            over.append(f"{pid} admitted with {len(in_flight) - 1} in flight")
    return Check(
        "prompts generating at once within verl's max_concurrent_samples",
        not over,
        f"at most {widest} in flight, bound {bound} (max_concurrent_samples={budget.max_concurrent_samples} and the "
        f"one verl holds); {len(over)} admissions over it{examples(over)}",
    )
