"""RewardSources: the stream's reward step. It runs the block's reward sources, scores again what failed when the
failure policy says so, combines the scores into each sample's reward as verl does, and marks what a failure makes
of a sample.

Input columns:  prompt_id and the rule stage's (sample_id, response_text, ground_truth, data_source);
                reward_sources when a reward model stage ran before this one (stages/reward_model.py)
Output columns: input columns + reward (float32), reward_error (string), reward_extra_info (string),
                reward_sources (map: source name -> its record), reward_status (string)

The sources, each named in reward_sources:
- 'rule' or 'custom': the rule stage (stages.reward.Reward by default): each data source's built-in verifier, or verl's
  custom_reward_function for every sample ('custom').
- 'reward_model': a discriminative reward model, which runs in an actor stage of its own before this step (so its
  records arrive with the block).
- 'judge': a generative judge (stages/judge.py), in an actor stage of its own before this step, the same way.
- 'remote': an HTTP reward service (stages/remote_reward.py), called from here.

How they combine is verl's reward loop's rule: a custom reward function, when configured, gives the reward, and it
sees the score of every model source that ran before it in `extra_info["reward_scores"]` (verl hands it the reward
model's address instead; here the model has already scored); without one, the model source's score is the reward
(verl: a discriminative reward model replaces the rule score); with neither, the data source's verifier gives it.
Two sources that give a score (a reward model, a judge, a remote service) and no function to combine them is a
configuration error (pipeline/config/reward.py).

A sample fails when a source it needs fails (the rule stage's reward_error, a model's or a service's error); a
sample whose model source failed is not handed to the custom function. `on_error` decides what it becomes:
- 'zero': reward 0, trained as if it were a real, wrong answer. In a group-normalised estimator that 0 moves the
  group's mean and std and so every other member's advantage (tests/unit/test_reward_sources.py measures it).
- 'retry': each failed source is called again for the samples it failed on, up to `max_attempts` calls in all,
  `backoff_s` doubling between rounds; what still fails is masked.
- 'mask': the sample leaves the loss and its group's statistics (the advantage stage reads reward_status: its
  response_mask and advantages become 0, and its group's baseline is computed over the others).
- 'drop_group': every member of a group with a failed sample is marked 'dropped'. The training sink leaves the
  group out and the gate admits a prompt in its place (stages/sink.py), so every step still trains its full batch.
Every failed sample keeps its error in reward_error and its source's record, in the sample log; the audit counts them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns

OnError = Literal["zero", "retry", "mask", "drop_group"]
ON_ERROR = ("zero", "retry", "mask", "drop_group")
# reward_status values; the advantage stage leaves the last two out of the loss.
OK, ZEROED, MASKED, DROPPED = "ok", "zero", "masked", "dropped"
LEFT_OUT = (MASKED, DROPPED)
MAX_BACKOFF_S = 30.0
Stage = Callable[[pa.Table], pa.Table]


def record(
    score: float | None, error: str | None, latency_s: float, attempts: int = 1, output: str | None = None
) -> dict[str, Any]:
    """One source's record of one sample (schemas.SOURCE_RECORD): a score, or the error that stands for it, and what
    a generative source said."""
    return {
        "score": None if error else score,
        "error": error,
        "latency_s": float(latency_s),
        "attempts": attempts,
        "output": output,
    }


def records_of(table: pa.Table) -> list[dict[str, dict[str, Any]]]:
    """Each row's records by source name (empty dicts when no source has run)."""
    if "reward_sources" not in table.column_names:
        return [{} for _ in range(table.num_rows)]
    return [dict(entries or []) for entries in table.column("reward_sources").to_pylist()]


def with_records(table: pa.Table, records: list[dict[str, dict[str, Any]]]) -> pa.Table:
    """`table` with its reward_sources column set to `records` (added, or replaced)."""
    field = SAMPLE_SCHEMA.field("reward_sources")
    column = pa.array([list(r.items()) for r in records], field.type)
    if "reward_sources" in table.column_names:
        return table.set_column(table.schema.get_field_index("reward_sources"), field, column)
    return table.append_column(field, column)


class RewardSources:
    def __init__(
        self,
        rule: Stage | None = None,
        rule_name: str = "rule",
        remote: Stage | None = None,
        model_sources: tuple[str, ...] = (),
        on_error: OnError = "mask",
        max_attempts: int = 3,
        backoff_s: float = 1.0,
    ) -> None:
        """`rule`: the rule stage, None when a model source alone gives the reward; `rule_name`: 'custom' when it
        runs a custom reward function; `remote`: the HTTP service's stage, if any; `model_sources`: the sources that
        score in stages of their own before this one ('reward_model'), whose records this step expects."""
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error {on_error!r}: expected one of {', '.join(ON_ERROR)}")
        if max_attempts < 1 or backoff_s < 0:
            raise ValueError(
                f"RewardSources needs max_attempts >= 1 and backoff_s >= 0, got {max_attempts}, {backoff_s}"
            )
        scorers = model_sources + (("remote",) if remote is not None else ())
        if rule is None and len(scorers) != 1:
            raise ValueError(f"without a rule stage exactly one model source gives the reward, got {list(scorers)}")
        self.rule, self.rule_name, self.remote = rule, rule_name, remote
        self.model_sources, self.on_error = model_sources, on_error
        self.attempts = max_attempts if on_error == "retry" else 1
        self.backoff_s = backoff_s

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(
            batch, ["prompt_id", "sample_id"] + (["reward_sources"] if self.model_sources else []), "RewardSources"
        )
        records = records_of(batch)
        missing = [s for s in self.model_sources if any(s not in r for r in records)]
        if missing:
            raise ValueError(f"RewardSources expects every sample scored by {missing} before it; some are not")
        extras: list[str | None] = [None] * batch.num_rows
        if self.remote is not None:
            self._run(self._remote, "remote", batch, records, extras, range(batch.num_rows))
        if self.rule is None:
            (source,) = self.model_sources + (("remote",) if self.remote is not None else ())
        else:  # the rule stage sees the model sources' scores; a sample one of them failed is not handed to it
            source = self.rule_name
            ready = [i for i, r in enumerate(records) if _error_of(r) is None]
            self._run(self._rule, source, with_records(batch, [dict(r) for r in records]), records, extras, ready)
        rewards = [(r[source]["score"] if source in r else None) or 0.0 for r in records]
        return self._finish(with_records(batch, records), rewards, [_error_of(r) for r in records], extras)

    def _remote(self, rows: pa.Table) -> list[tuple[dict, str | None]]:
        return [(r["remote"], None) for r in records_of(self.remote(rows))]

    def _rule(self, rows: pa.Table) -> list[tuple[dict, str | None]]:
        """The rule stage's reward as its record (its time: the block's, whose samples it scores side by side)."""
        t0 = time.monotonic()
        scored = self.rule(rows)
        block_s = time.monotonic() - t0
        columns = (scored.column(c).to_pylist() for c in ("reward", "reward_error", "reward_extra_info"))
        return [(record(r, e, block_s), x if e is None else None) for r, e, x in zip(*columns, strict=True)]

    def _run(
        self,
        call: Callable[[pa.Table], list[tuple[dict, str | None]]],
        name: str,
        batch: pa.Table,
        records: list[dict],
        extras: list[str | None],
        rows: range | list[int],
    ) -> None:
        """Record `call`'s work on `rows` under `name`, calling it again on the rows it failed while attempts are
        left (the attempts and the time of a retried sample add up)."""
        todo = list(rows)
        for attempt in range(1, self.attempts + 1):
            if not todo:
                return
            if attempt > 1:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 2), MAX_BACKOFF_S))
            failed = []
            for i, (new, extra) in zip(todo, call(batch.take(pa.array(todo, pa.int64()))), strict=True):
                before = records[i].get(name)
                if before is not None:
                    new = new | {
                        "attempts": before["attempts"] + new["attempts"],
                        "latency_s": before["latency_s"] + new["latency_s"],
                    }
                records[i][name], extras[i] = new, extra
                if new["error"]:
                    failed.append(i)
            todo = failed

    def _finish(self, batch: pa.Table, rewards: list, errors: list, extras: list) -> pa.Table:
        """The reward columns: a failed sample's reward is 0 whatever its status."""
        status = self._status(batch, errors)
        rewards = [0.0 if e else r for r, e in zip(rewards, errors, strict=True)]
        for name, values, kind in (
            ("reward", rewards, pa.float32()),
            ("reward_error", errors, pa.string()),
            ("reward_extra_info", extras, pa.string()),
            ("reward_status", status, pa.string()),
        ):
            batch = batch.append_column(SAMPLE_SCHEMA.field(name), pa.array(values, kind))
        return batch

    def _status(self, batch: pa.Table, errors: list[str | None]) -> list[str]:
        failed = np.array([e is not None for e in errors], bool)
        if self.on_error == "zero":
            return [ZEROED if f else OK for f in failed]
        if self.on_error != "drop_group":
            return [MASKED if f else OK for f in failed]
        groups: dict[str, list[int]] = defaultdict(list)
        for i, pid in enumerate(batch.column("prompt_id").to_pylist()):
            groups[pid].append(i)
        status = [OK] * len(errors)
        for rows in groups.values():
            if failed[rows].any():
                for i in rows:
                    status[i] = DROPPED
        return status


def _error_of(records: dict[str, dict]) -> str | None:
    """The first failing source's error, named by its source."""
    return next((f"{name}: {r['error']}" for name, r in records.items() if r["error"]), None)
