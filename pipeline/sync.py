"""Weight-sync orchestration between the trainer actor, the VersionClock and the Generate replicas.

`weight_sync.mode: push` (verl's and AReaL's way): the clock stops admitting, the trainer broadcasts
while every replica pauses its engine (in-flight requests finish with the old weights, or are interrupted with
partial rollout), receives, relabels its version and resumes; only when every replica has acknowledged does the
clock advance the version and admit again. The trainer is blocked for all of it.

`weight_sync.mode: pull` (StreamRL's and AsyncFlow's way): the trainer writes the new version to a parameter store
(one safetensors file under `weight_sync.store`: shared memory on one node by default, any fsspec URL across
nodes), the clock advances the version at once and tells the replicas, and the trainer goes back to training.
Each replica loads the newest version at its own safe point: at once with partial rollout (its requests are
interrupted and resumed), else after its requests in flight finish. Replicas may run different versions for a
while. The staleness bound stays exact: a replica starts no prompt admitted at a version newer than its weights
(it waits for its load first), so no token is older than its prompt's admission version, as in push mode.

Either way `sync/trainer_blocked_s` is how long the trainer waited, and `sync/engine_paused_s` how long the
slowest engine stood still (pause, transfer, resume); every replica's load is logged in weight_loads.jsonl.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import fsspec
import ray

from stages.engine_busy import idle_ratio

TIMEOUT_S = 600.0


def connect(trainer, clock, num_replicas: int) -> None:
    """Form the private weight-sync group: trainer rank 0, replica r at rank r + 1."""
    joined = ray.get(clock.wait_replicas.remote(TIMEOUT_S))
    if joined < num_replicas:
        raise RuntimeError(f"only {joined} of {num_replicas} Generate replicas started within {TIMEOUT_S}s")
    group = ray.get(trainer.open_weight_sync.remote(num_replicas + 1))
    seq = ray.get(clock.post.remote({"kind": "init_group", "world_size": num_replicas + 1, **group}))
    ray.get(trainer.wait_weight_sync.remote())
    ray.get(clock.wait_acks.remote(seq, TIMEOUT_S))


def push(trainer, clock, version: int) -> dict[str, float]:
    """Push the trainer's weights as `version`; returns sync metrics."""
    start = time.monotonic()
    meta = ray.get(trainer.weight_meta.remote())
    ray.get(clock.pause_admission.remote())
    seq = ray.get(clock.post.remote({"kind": "sync", "version": version, **meta}))
    sent = ray.get(trainer.push_weights.remote())
    acks = ray.get(clock.wait_acks.remote(seq, TIMEOUT_S))
    ray.get(clock.finish_sync.remote(version))
    blocked = time.monotonic() - start
    return {
        **sent,
        "sync/latency_s": blocked,
        "sync/trainer_blocked_s": blocked,
        "sync/engine_paused_s": max(a["pause_s"] + a["transfer_s"] + a["resume_s"] for a in acks),
        "sync/pause_s": max(a["pause_s"] for a in acks),
        "sync/transfer_s": max(a["transfer_s"] for a in acks),
        "sync/resume_s": max(a["resume_s"] for a in acks),
        "rollouter/idle_ratio": idle_ratio(acks),  # over the window since the previous sync, every engine
    }


class Push:
    """verl's push: the first sync also forms the broadcast group (the replicas exist once the stream runs)."""

    def __init__(self, trainer, clock, num_replicas: int, run_dir: Path) -> None:
        self.trainer, self.clock, self.num_replicas, self.connected = trainer, clock, num_replicas, False
        self.log = Path(run_dir) / "weight_loads.jsonl"

    def sync(self, version: int) -> dict[str, float]:
        if not self.connected:
            connect(self.trainer, self.clock, self.num_replicas)
            self.connected = True
        metrics = push(self.trainer, self.clock, version)
        _log_loads(
            self.log, [{"replica": r, "version": version, "loaded_at": time.time()} for r in range(self.num_replicas)]
        )
        return metrics

    def collect(self, wait: bool = False) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class Pull:
    """Pull mode: publish to the store and return; the replicas load on their own (see the module docstring)."""

    def __init__(self, trainer, clock, store: str, run_dir: Path) -> None:
        self.trainer, self.clock = trainer, clock
        self.store = store_root(store, run_dir)
        self.log = Path(run_dir) / "weight_loads.jsonl"
        self.pending: list[int] = []  # load messages whose acknowledgements are not all in
        self.published: list[str] = []

    def sync(self, version: int) -> dict[str, float]:
        start = time.monotonic()
        url = f"{self.store}/version-{version:06d}.safetensors"
        sent = ray.get(self.trainer.publish_weights.remote(url))
        self.pending.append(ray.get(self.clock.publish.remote(version, url)))
        self.published.append(url)
        self._prune()
        return {**sent, "sync/trainer_blocked_s": time.monotonic() - start}

    def _prune(self) -> None:
        """Keep the three newest files: a replica still draining loads the newest when it gets there."""
        fs, _ = fsspec.core.url_to_fs(self.store)
        while len(self.published) > 3:
            old = self.published.pop(0)
            if fs.exists(old):  # a simulated trainer writes no file
                fs.rm(old)

    def collect(self, wait: bool = False) -> dict[str, float]:
        """Metrics of the replicas' loads that have all been acknowledged."""
        metrics: dict[str, float] = {}
        while self.pending:
            seq = self.pending[0]
            acks = ray.get(
                self.clock.wait_acks.remote(seq, TIMEOUT_S) if wait else self.clock.acks_if_complete.remote(seq)
            )
            if acks is None:
                break
            self.pending.pop(0)
            loads = [a for a in acks if "pause_s" in a]  # a replica that was already newer skips the message
            _log_loads(self.log, loads)
            if loads:
                metrics["sync/engine_paused_s"] = max(a["pause_s"] + a["transfer_s"] + a["resume_s"] for a in loads)
                metrics["rollouter/idle_ratio"] = idle_ratio(loads)
        return metrics

    def close(self) -> None:
        if self.store.startswith("/dev/shm/"):
            shutil.rmtree(self.store, ignore_errors=True)


def store_root(store: str, run_dir: Path) -> str:
    """`weight_sync.store`, or by default a directory in shared memory private to this run and driver."""
    return (store or f"/dev/shm/asyncrl-{Path(run_dir).name}-{os.getpid()}").rstrip("/")


def make_syncer(cfg, trainer, clock, run_dir: Path) -> Push | Pull:
    if cfg.weight_sync.mode == "pull":
        return Pull(trainer, clock, cfg.weight_sync.store, run_dir)
    return Push(trainer, clock, cfg.rollout.num_replicas, run_dir)


def _log_loads(path: Path, loads: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for load in loads:
            f.write(json.dumps({k: load[k] for k in ("replica", "version", "loaded_at") if k in load}) + "\n")
