"""Validation at sync points, as verl's fully-async recipe does it (`rollout.test_freq`, `trainer.val_before_train`).

Right after the sync that makes weight version v (every `test_freq` versions), the driver posts the held-out
prompts to the Generate replicas through the VersionClock, the same channel as the syncs, and goes on training.
Each replica generates its share (`rollout.val_kwargs.n` responses per prompt) beside the training stream's
requests, in the same engine. A replica handles its control messages one at a time, so the next sync waits
until the validation before it is done: the engine's weights cannot change under a validation request, and a
validation result from mixed weight versions is impossible by construction (each sample also carries its
per-token versions, and the driver refuses a pass whose tokens disagree). Training stalls only when a pass takes
longer than the steps up to the next sync. The driver scores finished passes with the reward stage's verifiers
and logs `val/<data_source>/reward/mean@n`, `best@n` and, for 0/1 rewards, `pass@1` and `pass@n`, with
`val/version`; the samples go to `<run_dir>/validation/version-<v>.parquet`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from stages.reward import Reward


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `correct` of `n` samples right: 1 - C(n-c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def val_metrics(rows: list[dict[str, Any]], n: int) -> dict[str, float]:
    """Metrics per data source from scored samples (prompt_id, data_source, reward)."""
    by_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        by_source[row["data_source"]][row["prompt_id"]].append(row["reward"])
    metrics = {}
    for source, prompts in sorted(by_source.items()):
        groups = list(prompts.values())
        key = f"val/{source}/reward"
        metrics[f"{key}/mean@{n}"] = sum(sum(g) for g in groups) / sum(len(g) for g in groups)
        metrics[f"{key}/best@{n}"] = sum(max(g) for g in groups) / len(groups)
        if all(r in (0.0, 1.0) for g in groups for r in g):  # pass@k needs a right/wrong verdict
            for k in sorted({1, n}):
                metrics[f"{key}/pass@{k}"] = sum(pass_at_k(len(g), int(sum(g)), k) for g in groups) / len(groups)
    return metrics


class Validator:
    """Starts a validation pass after a sync when the config asks for one, and collects finished passes."""

    def __init__(self, clock, prompts: pa.Table | None, rollout, run_dir: Path) -> None:
        """`rollout`: the run's RolloutConfig (test_freq, val_kwargs, num_replicas)."""
        self.clock, self.prompts, self.test_freq = clock, prompts, rollout.test_freq
        self.kwargs = {**dataclasses.asdict(rollout.val_kwargs), "replicas": rollout.num_replicas}
        self.out = Path(run_dir) / "validation"
        self.pending: list[tuple[int, int]] = []  # (message seq, version)
        self.score = Reward()

    @property
    def enabled(self) -> bool:
        return self.prompts is not None and self.prompts.num_rows > 0

    def after_sync(self, version: int) -> None:
        if self.enabled and self.test_freq > 0 and version % self.test_freq == 0:
            self.start(version)

    def start(self, version: int) -> None:
        """Post the held-out prompts for `version` (the version the replicas hold once they reach the message)."""
        if not self.enabled:
            return
        rows = self.prompts.select(["prompt_id", "prompt_ids", "prompt_text", "ground_truth", "data_source"])
        message = {"kind": "validate", "version": version, "rows": rows.to_pylist(), **self.kwargs}
        self.pending.append((ray.get(self.clock.post.remote(message)), version))

    def collect(self, wait: bool = False) -> dict[str, float]:
        """Metrics of the latest pass that has finished (with `wait`: of every pass); every pass is also in
        validation/metrics.jsonl."""
        metrics: dict[str, float] = {}
        while self.pending:
            seq, version = self.pending[0]
            acks = ray.get(self.clock.wait_acks.remote(seq, 600.0) if wait else self.clock.acks_if_complete.remote(seq))
            if acks is None:
                break
            self.pending.pop(0)
            metrics = self._finish(version, [row for ack in acks for row in ack["samples"]])
        return metrics

    def _finish(self, posted: int, samples: list[dict[str, Any]]) -> dict[str, float]:
        """Score a pass and tag it with the one version all its tokens share: the one posted, or in pull mode a
        newer one a replica had already loaded when it reached the message."""
        seen = {v for s in samples for v in s["token_param_version"]}
        if len(seen) > 1 or min(seen, default=posted) < posted:
            raise RuntimeError(
                f"validation pass posted at version {posted} has tokens of versions {sorted(seen)}: the engine's "
                "weights changed during a validation request"
            )
        version = seen.pop() if seen else posted
        table = self.score(pa.Table.from_pylist(samples))
        self.out.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, self.out / f"version-{version:06d}.parquet")
        metrics = {**val_metrics(table.to_pylist(), self.kwargs["n"]), "val/version": float(version)}
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        return metrics
