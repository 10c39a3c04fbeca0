"""Audit a run from its logs alone: staleness bound, token versions, exactly-once consumption, MoE route rows, reward
failures.

Reads `<run>/samples` (every generated sample), `<run>/consumed` (what the trainer trained on, at which version),
`<run>/admitted.parquet` (the gate's ledger), `<run>/config.yaml` (for the bound) and the model's config.json (for
the width of a route row). Nothing here trusts the
process that produced the run: the verdict is recomputed from what is on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pds
import pyarrow.parquet as pq
from omegaconf import OmegaConf

from pipeline.observe.reward_audit import left_out, reward_failures
from stages.staleness import StalenessBudget


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


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

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        lines = [f"{'check':<{width}}  result  detail"]
        lines += [f"{c.name:<{width}}  {'PASS' if c.ok else 'FAIL':<6}  {c.detail}" for c in self.checks]
        return "\n".join(lines)


def read_dir(path: Path) -> pa.Table | None:
    return pds.dataset(str(path), format="parquet").to_table() if path.exists() and any(path.iterdir()) else None


def budget_of(run_dir: Path) -> StalenessBudget:
    return StalenessBudget.from_config(OmegaConf.load(run_dir / "config.yaml"))


def audit(run_dir: str | Path) -> AuditReport:
    run_dir = Path(run_dir)
    budget = budget_of(run_dir)
    samples = read_dir(run_dir / "samples")
    consumed = read_dir(run_dir / "consumed")
    admitted = pq.read_table(run_dir / "admitted.parquet")
    report = AuditReport(lag_bound=budget.lag_bound, admitted_prompts=admitted.num_rows)
    if samples is None or consumed is None:
        report.checks.append(Check("logs present", False, f"no samples or no consumption log in {run_dir}"))
        return report
    joined = consumed.join(samples.select(["sample_id", "param_version", "param_version_end"]), "sample_id")
    report.consumed_samples = consumed.num_rows
    lags = pc.subtract(joined["consumed_version"], joined["param_version"])
    report.max_lag = int(pc.max(lags).as_py()) if len(lags) else 0
    report.checks += [
        Check(
            "every consumed sample is in the sample log",
            joined.num_rows == consumed.num_rows,
            f"{joined.num_rows}/{consumed.num_rows} found",
        ),
        Check(
            "lag <= bound", report.max_lag <= budget.lag_bound, f"max lag {report.max_lag}, bound {budget.lag_bound}"
        ),
        _partial_span(joined, budget.lag_bound),
        _monotone_versions(samples),
        _per_token_columns(samples),
        _exactly_once(consumed),
    ]
    if "routed_experts" in samples.column_names and samples["routed_experts"].null_count < samples.num_rows:
        report.checks.append(_route_rows(samples, route_width(run_dir)))
    failures = reward_failures(samples)
    if failures is not None:
        report.checks.append(Check("every failed reward accounted for", *failures))
    report.checks.append(_admissions(admitted, consumed, report))
    return report


def _monotone_versions(samples: pa.Table) -> Check:
    bad = 0
    for versions, oldest in zip(
        samples["token_param_version"].to_pylist(), samples["param_version"].to_pylist(), strict=True
    ):
        if versions and (any(b < a for a, b in zip(versions, versions[1:], strict=False)) or versions[0] != oldest):
            bad += 1
    return Check("token versions never decrease", bad == 0, f"{bad} of {samples.num_rows} responses violate it")


def _per_token_columns(samples: pa.Table) -> Check:
    """Every per-token column has num_tokens entries, and masked tokens (an agent loop's tool results) carry
    logprob 0: the trainer's response_mask then drops exactly them, and their versions stay in the lag bound. A
    sample whose reward left it out of the loss is masked whole, generated tokens included (reward_audit checks it)."""
    columns = ["response_ids", "response_logprobs", "token_param_version", "response_mask"]
    bad = masked = 0
    rows = zip(
        samples["num_tokens"].to_pylist(), left_out(samples), *(samples[c].to_pylist() for c in columns), strict=True
    )
    for n, reward_left_out, ids, logprobs, versions, mask in rows:
        lined_up = len(ids) == len(logprobs) == len(versions) == len(mask) == n
        zeros = [] if reward_left_out else [i for i, m in enumerate(mask or []) if m == 0]  # masked whole: its reward
        masked += len(zeros)
        if not lined_up or any(logprobs[i] != 0.0 for i in zeros):
            bad += 1
    return Check(
        "per-token columns line up",
        bad == 0,
        f"{bad} of {samples.num_rows} responses violate it; {masked} masked (tool) tokens",
    )


def route_width(run_dir: Path) -> int | None:
    """layers * k of the run's model (a row of routed_experts), from its config.json; None if it cannot tell.

    MoE layers follow the Qwen-MoE convention (every decoder_sparse_step-th layer, minus mlp_only_layers)."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    path = run_dir / "model" if cfg.model.path == "embedded" else Path(cfg.model.path)
    try:
        model = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    k, layers = model.get("num_experts_per_tok"), model.get("num_hidden_layers")
    if not k or not layers:
        return None
    step, dense = model.get("decoder_sparse_step") or 1, set(model.get("mlp_only_layers") or [])
    return k * sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)


def _route_rows(samples: pa.Table, width: int | None) -> Check:
    """Samples with routes have one row per token of prompt + response but the last, each of layers * k expert ids
    (one width for all when the model's config cannot tell it): routes appended on a resume would show here."""
    bad = 0
    widths: set[int] = set()
    columns = ("prompt_ids", "response_ids", "routed_experts")
    for prompt, response, routes in zip(*(samples[c].to_pylist() for c in columns), strict=True):
        if routes is None:
            continue
        widths.update(len(r) for r in routes)
        if len(routes) != len(prompt) + len(response) - 1 or any(len(r) != (width or len(routes[0])) for r in routes):
            bad += 1
    uniform = width is not None or len(widths) <= 1
    return Check(
        "routes: one row per context token",
        bad == 0 and uniform,
        f"{bad} of {samples.num_rows} responses violate it; row width {sorted(widths)}, model's {width or 'unknown'}",
    )


def _partial_span(joined: pa.Table, bound: int) -> Check:
    spans = pc.subtract(joined["param_version_end"], joined["param_version"])
    widest = int(pc.max(spans).as_py()) if len(spans) else 0
    partial = int(pc.sum(pc.greater(spans, 0)).as_py() or 0)
    return Check(
        "partial span <= bound",
        widest <= bound,
        f"{partial} trained responses span versions, widest span {widest}, bound {bound}",
    )


def _exactly_once(consumed: pa.Table) -> Check:
    ids = consumed["sample_id"]
    dupes = len(ids) - len(pc.unique(ids))
    return Check("no sample consumed twice", dupes == 0, f"{dupes} duplicate consumptions")


def _admissions(admitted: pa.Table, consumed: pa.Table, report: AuditReport) -> Check:
    admitted_ids = set(admitted["prompt_id"].to_pylist())
    consumed_ids = set(consumed["prompt_id"].to_pylist())
    stray = consumed_ids - admitted_ids
    report.unconsumed_prompts = len(admitted_ids - consumed_ids)
    dup_admissions = admitted.num_rows - len(admitted_ids)
    return Check(
        "every admitted prompt consumed once or reported in flight",
        not stray and not dup_admissions,
        f"{len(consumed_ids)} consumed, {report.unconsumed_prompts} in flight at the end, "
        f"{len(stray)} consumed without admission, {dup_admissions} admitted twice",
    )
