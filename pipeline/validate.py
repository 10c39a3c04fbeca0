"""Validation at sync points, as verl's fully-async recipe does it (`rollout.test_freq`, `trainer.val_before_train`).

Right after the sync that makes weight version v (every `test_freq` versions), the driver posts the held-out
prompts to the Generate replicas through the VersionClock, the same channel as the syncs, and goes on training.
Each replica generates its share (`rollout.val_kwargs.n` responses per prompt) beside the training stream's
requests, in the same engine. A replica handles its control messages one at a time, so the next sync waits
until the validation before it is done: the engine's weights cannot change under a validation request, and a
validation result from mixed weight versions is impossible by construction (each sample also carries its
per-token versions, and the driver refuses a pass whose tokens disagree). Training stalls only when a pass takes
longer than the steps up to the next sync. With `async_training.parallel_validate_and_rollout=false` (verl's
default) a replica also holds its new training requests until its share is done.

With `async_training.use_trainer_do_validate` the pass runs on a dedicated engine outside the stream instead
(verl runs it on replicas beside the trainer): the trainer writes the version to the weight store, which costs it
one file write, and the engine loads that file and validates while the stream's engines never see a validation
request nor wait for one. It runs one pass at a time, loading between passes, so here too a pass has one version.

The driver scores finished passes with the reward stage's verifiers
and logs `val/<data_source>/reward/mean@n`, `best@n` and, for 0/1 rewards, `pass@1` and `pass@n`, with
`val/version`; the samples go to `<run_dir>/validation/version-<v>.parquet`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.stream import start_validation_engine
from pipeline.sync import store_root
from stages.control import Ack, Failed, Validate, Validated
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

    def __init__(self, clock, prompts: pa.Table | None, cfg, run_dir: Path, engine=None, trainer=None) -> None:
        """`cfg`: the RunConfig. `engine`: the dedicated validation engine, if any; the trainer then writes each
        validated version to `weight_sync.store` for it."""
        ro = cfg.rollout
        self.clock, self.prompts, self.test_freq, self.replicas = clock, prompts, ro.test_freq, ro.num_replicas
        self.sampling, self.parallel = ro.val_kwargs, cfg.async_training.parallel_validate_and_rollout
        self.engine, self.trainer = engine, trainer
        self.store = f"{store_root(cfg.weight_sync.store, run_dir)}/validation"
        self.out = Path(run_dir) / "validation"
        self.posted = False  # a pass has been posted to the replicas (so they have all joined once)
        self.pending: list[tuple[Any, int]] = []  # (message seq, or the dedicated engine's ObjectRef; version)
        crf = cfg.reward.custom_reward_function  # validation scores as training does
        self.score = Reward(
            custom_path=crf.path,
            custom_name=crf.name,
            reward_kwargs=dict(crf.reward_kwargs),
            manager=cfg.reward_manager(),
        )

    @property
    def enabled(self) -> bool:
        return self.prompts is not None and self.prompts.num_rows > 0

    def after_sync(self, version: int) -> dict[str, float]:
        if self.enabled and self.test_freq > 0 and version % self.test_freq == 0:
            return self.start(version)
        return {}

    def start(self, version: int) -> dict[str, float]:
        """Post the held-out prompts for `version` (the version the replicas hold once they reach the message), or
        hand them to the dedicated engine with the version's weight file; returns what it cost the trainer."""
        if not self.enabled:
            return {}
        rows = self.prompts.select(["prompt_id", "prompt_ids", "prompt_text", "ground_truth", "data_source"])
        s = self.sampling
        message = Validate(version, rows.to_pylist(), s.n, s.temperature, s.top_p, self.parallel)
        if self.engine is None:
            # The replicas that are members when it is posted share it: the first time, wait until all have joined
            # (they start with the stream, so never before its first batch).
            joined = self.replicas if self.posted else ray.get(self.clock.wait_replicas.remote(600.0))
            if joined < self.replicas:
                raise RuntimeError(f"only {joined} of {self.replicas} Generate replicas started within 600 s")
            self.posted = True
            self.pending.append((ray.get(self.clock.post.remote(message)), version))
            return {}
        start = time.monotonic()
        url = f"{self.store}/version-{version:06d}.safetensors"
        ray.get(self.trainer.publish_weights.remote(url))
        self.pending.append((self.engine.validate_version.remote(dataclasses.replace(message, url=url)), version))
        return {"val/trainer_blocked_s": time.monotonic() - start}

    def collect(self, wait: bool = False) -> dict[str, float]:
        """Metrics of the latest pass that has finished (with `wait`: of every pass); every pass is also in
        validation/metrics.jsonl."""
        metrics: dict[str, float] = {}
        while self.pending:
            handle, version = self.pending[0]
            acks = self._acks(handle, wait)
            if acks is None:
                break
            self.pending.pop(0)
            for ack in acks:
                if isinstance(ack, Failed):  # its share is missing from the pass's metrics: say so
                    print(f"asyncrl: validation of version {version} failed on replica {ack.replica}: {ack.error}")
            metrics = self._finish(version, [row for ack in acks if isinstance(ack, Validated) for row in ack.samples])
            if self.engine is not None:
                _remove(f"{self.store}/version-{version:06d}.safetensors")
        return metrics

    def _acks(self, handle, wait: bool) -> list[Ack] | None:
        if self.engine is not None:  # the dedicated engine's ObjectRef
            done, _ = ray.wait([handle], timeout=None if wait else 0)
            return [ray.get(handle)] if done else None
        clock = self.clock
        return ray.get(clock.wait_acks.remote(handle, 600.0) if wait else clock.acks_if_complete.remote(handle))

    def close(self) -> None:
        """Remove the dedicated engine's weight files (also when the run failed)."""
        if self.engine is not None:
            fs, path = fsspec.core.url_to_fs(self.store)
            if fs.exists(path):
                fs.rm(path, recursive=True)
            root = os.path.dirname(self.store)
            if root.startswith("/dev/shm/") and os.path.isdir(root) and not os.listdir(root):
                os.rmdir(root)  # the run's default store, which only validation used (push mode)

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
        metrics = {**val_metrics(table.to_pylist(), self.sampling.n), "val/version": float(version)}
        with open(self.out / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(metrics) + "\n")
        return metrics


def make_validator(cfg, ctx, clock, trainer) -> Validator:
    """The run's Validator; with `use_trainer_do_validate` (and held-out prompts) it starts the dedicated engine."""
    engine = None
    if cfg.async_training.use_trainer_do_validate and ctx.val_prompts is not None:
        engine = start_validation_engine(cfg, str(ctx.model_dir), ctx.clock_handle, ctx.start_version)
    return Validator(clock, ctx.val_prompts, cfg, ctx.run_dir, engine, trainer)


def _remove(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path)
