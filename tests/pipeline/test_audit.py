"""The audit fails when a run's logs break its rules: the logs of one real run (the shared partial-rollout run of
conftest.py), copied and corrupted one way at a time. Each corruption must fail the audit, and the check of its rule
must name the sample (or prompt, version or step) that breaks it; the logs as the run left them pass every check."""

from __future__ import annotations

import copy
import json
import re
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from pipeline.observe.audit import audit
from schemas import ADMITTED_SCHEMA, CONSUMED_SCHEMA, SAMPLE_SCHEMA
from stages.staleness import StalenessBudget


class Logs:
    """A run's logs as rows, to corrupt and write to a directory of their own."""

    def __init__(self, run_dir: Path) -> None:
        self.config = (run_dir / "config.yaml").read_text()
        self.samples = pds.dataset(str(run_dir / "samples")).to_table().to_pylist()
        self.consumed = pds.dataset(str(run_dir / "consumed")).to_table().to_pylist()
        self.admitted = pq.read_table(run_dir / "admitted.parquet").to_pylist()
        self.metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def write(self, run_dir: Path) -> Path:
        (run_dir / "samples").mkdir(parents=True)
        (run_dir / "consumed").mkdir()
        (run_dir / "config.yaml").write_text(self.config)
        pq.write_table(pa.Table.from_pylist(self.samples, SAMPLE_SCHEMA), run_dir / "samples" / "part-0.parquet")
        pq.write_table(pa.Table.from_pylist(self.consumed, CONSUMED_SCHEMA), run_dir / "consumed" / "step.parquet")
        pq.write_table(pa.Table.from_pylist(self.admitted, ADMITTED_SCHEMA), run_dir / "admitted.parquet")
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in self.metrics))
        return run_dir

    def sample(self, sample_id: str) -> dict:
        return next(s for s in self.samples if s["sample_id"] == sample_id)

    def trained(self) -> list[dict]:
        """The consumed rows joined with their samples."""
        by_id = {s["sample_id"]: s for s in self.samples}
        return [{**by_id[c["sample_id"]], **c} for c in self.consumed]


@pytest.fixture(scope="module")
def run_logs(partial_run) -> Logs:
    return Logs(partial_run[1])


@pytest.fixture
def logs(run_logs) -> Logs:
    return copy.deepcopy(run_logs)


# --- one corruption per rule: each returns what the failing check must name --------------------------------------
def lag_over_the_bound(logs: Logs) -> str:
    row = logs.consumed[len(logs.consumed) // 2]
    row["consumed_version"] = logs.sample(row["sample_id"])["param_version"] + 2  # the audited run's bound is 1
    return row["sample_id"]


def prompt_trained_twice(logs: Logs) -> str:
    pid = logs.consumed[0]["prompt_id"]
    last = max(c["consumed_step"] for c in logs.consumed)
    logs.consumed += [{**c, "consumed_step": last} for c in logs.consumed if c["prompt_id"] == pid]
    return f"{pid}/0"


def consumed_sample_not_logged(logs: Logs) -> str:
    sid = logs.consumed[len(logs.consumed) // 2]["sample_id"]
    logs.samples = [s for s in logs.samples if s["sample_id"] != sid]
    return sid


def group_missing_one_response(logs: Logs) -> str:
    sid = logs.consumed[len(logs.consumed) // 3]["sample_id"]  # gone from both logs: the group trained on 3 of 4
    logs.samples = [s for s in logs.samples if s["sample_id"] != sid]
    logs.consumed = [c for c in logs.consumed if c["sample_id"] != sid]
    return sid.rsplit("/", 1)[0]


def token_older_than_admission(logs: Logs) -> str:
    row = next(r for r in logs.trained() if r["admitted_version"] >= 1)
    sample = logs.sample(row["sample_id"])
    sample["token_param_version"][0] = sample["param_version"] = row["admitted_version"] - 1
    return row["sample_id"]


def advantage_off_by_1e3(logs: Logs) -> str:
    sample = logs.sample(logs.consumed[-1]["sample_id"])
    sample["advantage"] += 1e-3
    return sample["sample_id"]


def token_advantage_off_by_1e3(logs: Logs) -> str:
    sample = logs.sample(logs.consumed[5]["sample_id"])
    sample["token_advantages"][-1] += 1e-3
    return sample["sample_id"]


def reward_changed_after_scoring(logs: Logs) -> str:
    """One sample's reward raised by 1 after its group's advantages were computed: the group's logged advantages
    (zero or not) are no longer what GRPO makes of its rewards."""
    sample = logs.sample(logs.consumed[7]["sample_id"])
    sample["reward"] += 1.0
    return sample["prompt_id"] + "/"


def window_over_the_budget(logs: Logs) -> str:
    """The ledger admits one prompt more at version 0 than verl's budget allows (in flight at the end, never
    generated: a prompt the gate should not have let in)."""
    budget = StalenessBudget.from_config(OmegaConf.create(logs.config))
    at_zero = sum(a["admitted_version"] == 0 for a in logs.admitted)
    time = logs.admitted[0]["admitted_time"]
    logs.admitted += [
        {"prompt_id": f"extra-{i}", "admitted_version": 0, "admitted_time": time}
        for i in range(budget.max_required_samples + 1 - at_zero)
    ]
    return "version 0"


def too_many_generating_at_once(logs: Logs) -> str:
    """The last max_concurrent_samples + 1 prompts admitted (generated late) moved to just before the first one:
    once it is admitted too, one prompt more than verl's bound is in flight."""
    budget = StalenessBudget.from_config(OmegaConf.create(logs.config))
    ledger = sorted(logs.admitted, key=lambda a: a["admitted_time"])
    first = ledger[0]
    for row in ledger[-(budget.max_concurrent_samples + 1) :]:
        row["admitted_time"] = first["admitted_time"] - 1.0
    return f"{first['prompt_id']} admitted"


def metrics_reward_off_by_half(logs: Logs) -> str:
    logs.metrics[4]["reward/mean"] += 0.5
    return f"step {logs.metrics[4]['step']} reward/mean"


def metrics_step_missing(logs: Logs) -> str:
    step = logs.metrics.pop(3)["step"]
    return f"step {step} trained, not logged"


def sample_logged_twice(logs: Logs) -> str:
    logs.samples.append(copy.deepcopy(logs.samples[3]))
    return logs.samples[3]["sample_id"]


def versions_decrease(logs: Logs) -> str:
    sample = next(s for s in logs.samples if s["param_version_end"] > s["param_version"])
    sample["token_param_version"][-1] = sample["param_version"] - 1 if sample["param_version"] else 0
    sample["token_param_version"][0] = sample["param_version"] = max(sample["param_version"], 1)
    return sample["sample_id"]


def span_over_the_bound(logs: Logs) -> str:
    sid = logs.consumed[0]["sample_id"]
    sample = logs.sample(sid)
    sample["param_version_end"] = sample["param_version"] + 2  # the audited run's bound is 1
    sample["token_param_version"][-1] = sample["param_version_end"]
    return sid


def logprob_missing(logs: Logs) -> str:
    sample = logs.samples[-1]
    sample["response_logprobs"] = sample["response_logprobs"][:-1]
    return sample["sample_id"]


def consumed_without_admission(logs: Logs) -> str:
    pid = logs.consumed[-1]["prompt_id"]
    logs.admitted = [a for a in logs.admitted if a["prompt_id"] != pid]
    return pid


MUTATIONS = {
    lag_over_the_bound: "lag <= bound",
    prompt_trained_twice: "no sample consumed twice",
    consumed_sample_not_logged: "every consumed sample is in the sample log",
    group_missing_one_response: "every consumed group is whole (4 responses)",
    token_older_than_admission: "no token older than its admission",
    advantage_off_by_1e3: "advantages recomputed from the rewards",
    token_advantage_off_by_1e3: "advantages recomputed from the rewards",
    reward_changed_after_scoring: "advantages recomputed from the rewards",
    window_over_the_budget: "admissions per version within verl's budget",
    too_many_generating_at_once: "prompts generating at once within verl's max_concurrent_samples",
    metrics_reward_off_by_half: "metrics.jsonl agrees with the logs",
    metrics_step_missing: "metrics.jsonl agrees with the logs",
    sample_logged_twice: "every sample logged once",
    versions_decrease: "token versions never decrease",
    span_over_the_bound: "partial span <= bound",
    logprob_missing: "per-token columns line up",
    consumed_without_admission: "every admitted prompt consumed or filtered once, or reported in flight",
}


@pytest.mark.slow
def test_the_run_as_it_left_its_logs_passes_every_check(logs, tmp_path):
    report = audit(logs.write(tmp_path / "run"))
    assert report.ok, report.table()
    assert {c.name for c in report.checks} >= set(MUTATIONS.values())
    assert not [c.name for c in report.checks if c.skipped], report.table()  # every rule applied to this run
    assert report.max_lag <= report.lag_bound == 1  # the corruptions below take it to 2
    assert Counter(c["prompt_id"] for c in logs.consumed).most_common(1)[0][1] == 4  # groups of 4, as named
    # verl's bound on prompts generating at once bound this run (2 a replica, and the one held), not only held
    assert "at most 3 in flight, bound 3 " in report.check(MUTATIONS[too_many_generating_at_once]).detail


@pytest.mark.slow
@pytest.mark.parametrize("mutate", list(MUTATIONS), ids=lambda f: f.__name__)
def test_each_corruption_fails_its_rule_naming_the_sample(logs, tmp_path, mutate):
    offender = mutate(logs)
    report = audit(logs.write(tmp_path / "run"))
    check = report.check(MUTATIONS[mutate])
    assert not report.ok and not check.ok, report.table()
    assert offender in check.detail, check.detail
    assert re.search(rf"^{re.escape(check.name)} +FAIL  ", report.table(), re.M), report.table()  # its row says so


@pytest.mark.slow
def test_check_mode_passes_the_run_and_fails_its_corruptions(partial_run, logs, tmp_path):
    """modes.check_mode, what each of verl's modes must show, on the same logs: the shared run is async with
    partial rollout (s = 0.5, a sync every step, 34 prompts at 4 per step, 4 responses each)."""
    from tests.pipeline.modes import check_mode

    summary, run_dir = partial_run
    check_mode(summary, run_dir, s=0.5, k=1, prompts=34, per_step=4, n=4)
    for mutate in (prompt_trained_twice, lag_over_the_bound, consumed_without_admission):
        broken = copy.deepcopy(logs)
        mutate(broken)
        with pytest.raises(AssertionError):
            check_mode(summary, broken.write(tmp_path / mutate.__name__), s=0.5, k=1, prompts=34, per_step=4, n=4)
