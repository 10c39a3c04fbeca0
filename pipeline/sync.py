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
slowest engine stood still (pause, transfer, resume); every replica's load is logged in weight_loads.jsonl, with the
number of its engine's workers (one per tensor-parallel rank) that loaded the version.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import fsspec
import ray

from stages.control import Ack, Failed, JoinGroup, Loaded, PushWeights
from stages.engine_busy import idle_ratio
from stages.transports import WeightMeta

TIMEOUT_S = 600.0


def group_ranks(members: list[int], engine_tp: int) -> tuple[int, dict[int, int]]:
    """The weight-sync group's size and each member replica's first rank: the trainer is rank 0, and the `engine_tp`
    workers of the i-th member (one per tensor-parallel rank of its engine) are ranks 1 + i * engine_tp onwards, each
    at its first rank plus its own TP rank. Every engine worker receives every tensor whole and loads its shard."""
    return 1 + len(members) * engine_tp, {r: 1 + i * engine_tp for i, r in enumerate(members)}


def connect(trainer, clock, members: list[int], timeout_s: float, engine_tp: int = 1) -> bool:
    """Form the private weight-sync group of the trainer (rank 0) and the engine workers of the replicas `members`
    (`group_ranks`), the group before it, if any, closed on both sides. False if it did not form within `timeout_s`
    (a member died while joining; the others gave up too, after the same timeout)."""
    world_size, ranks = group_ranks(members, engine_tp)
    address = ray.get(trainer.open_weight_sync.remote(world_size, timeout_s))
    seq = ray.get(clock.post.remote(JoinGroup(address, world_size, ranks), members))
    try:
        ray.get(trainer.wait_weight_sync.remote())
    except ray.exceptions.RayTaskError as err:  # the trainer is alive; a member never joined
        print(f"asyncrl: forming the weight-sync group with replicas {members} failed ({err.cause!r}); again")
        ray.get(clock.wait_acks.remote(seq, TIMEOUT_S))  # the live members' rendezvous end with the same timeout
        return False
    acks = ray.get(clock.wait_acks.remote(seq, TIMEOUT_S))
    return not any(isinstance(a, Failed) for a in acks)


def push(trainer, clock, version: int, members: list[int], meta: WeightMeta) -> tuple[list[Ack], dict] | None:
    """Broadcast the trainer's weights as `version` to `members` (admission paused by the caller): their
    acknowledgements and the trainer's numbers, or None if the broadcast failed (a replica died during it).
    `meta`: the trainer's weight_meta (names, shapes, dtypes), the same at every sync."""
    seq = ray.get(clock.post.remote(PushWeights(version, meta), members))
    try:
        sent = ray.get(trainer.push_weights.remote())
    except ray.exceptions.RayTaskError as err:  # the trainer is alive; its broadcast was cut short
        print(f"asyncrl: the weight push of version {version} failed ({err.cause!r}); forming the group again")
        ray.get(clock.wait_acks.remote(seq, TIMEOUT_S))  # the survivors' receives end with the closed group
        return None
    acks = ray.get(clock.wait_acks.remote(seq, TIMEOUT_S))
    return None if any(isinstance(a, Failed) for a in acks) else (acks, sent)


def sync_metrics(loads: list[Loaded], sent: dict[str, float]) -> dict[str, float]:
    if not loads:  # every replica died during the sync: they load the snapshot when they are back
        return dict(sent)
    return {
        **sent,
        "sync/engine_paused_s": max(a.paused_s for a in loads),
        "sync/pause_s": max(a.pause_s for a in loads),
        "sync/transfer_s": max(a.transfer_s for a in loads),
        "sync/resume_s": max(a.resume_s for a in loads),
        "rollouter/idle_ratio": idle_ratio([a.busy for a in loads]),  # since the previous sync, every engine
    }


class Push:
    """verl's push, to whichever replicas are alive: the group is formed at the first sync (the replicas exist once
    the stream runs) and again whenever a replica was restarted. With `snapshots`, each pushed version is also
    written to the store, for a restarted replica to load (the trainer's weights have moved on by then)."""

    def __init__(
        self,
        trainer,
        clock,
        num_replicas: int,
        run_dir: Path,
        snapshots: str = "",
        connect_timeout_s: float = 30.0,
        engine_tp: int = 1,
    ) -> None:
        self.trainer, self.clock, self.num_replicas = trainer, clock, num_replicas
        self.connect_timeout_s, self.engine_tp = connect_timeout_s, engine_tp
        self.group: dict[int, int] = {}  # the group's replicas: index -> generation
        self.started = False
        self.meta: WeightMeta | None = None  # the trainer's weight_meta: fetched once, it never changes in a run
        self.log = Path(run_dir) / "weight_loads.jsonl"
        self.snapshots = Snapshots(snapshots) if snapshots else None

    def connect(self, members: dict[int, int] | None = None) -> bool:
        """Form the group with the live replicas `members` (default: ask the clock; at the first sync, once every
        replica has started); False if a member died while it was formed."""
        if not self.started:
            joined = ray.get(self.clock.wait_replicas.remote(TIMEOUT_S))
            if joined < self.num_replicas:
                raise RuntimeError(f"only {joined} of {self.num_replicas} Generate replicas started in {TIMEOUT_S}s")
            self.started, members = True, None
        if members is None:
            members = ray.get(self.clock.members.remote())
        if members != self.group:
            if not connect(self.trainer, self.clock, sorted(members), self.connect_timeout_s, self.engine_tp):
                return False
            self.group = members
        return True

    def sync(self, version: int) -> dict[str, float]:
        start = time.monotonic()
        members = ray.get(self.clock.pause_admission.remote())
        if self.meta is None:
            self.meta = ray.get(self.trainer.weight_meta.remote())
        for _ in range(2 * self.num_replicas + 1):  # each retry follows a replica's death (in a formation or a push)
            formed = self.connect(members)  # sets self.group
            result = push(self.trainer, self.clock, version, sorted(self.group), self.meta) if formed else None
            if result is not None:
                break
            self.group, members = {}, None  # the push failed or the group never formed: again, with the survivors
        else:
            raise RuntimeError(f"the weight push of version {version} failed {2 * self.num_replicas + 1} times")
        acks, sent = result
        loads = [a for a in acks if isinstance(a, Loaded)]
        metrics = sync_metrics(loads, sent)
        snapshot = self.snapshots.write(self.trainer, version, metrics) if self.snapshots else None
        metrics.update(ray.get(self.clock.finish_sync.remote(version, snapshot)))
        metrics["sync/latency_s"] = metrics["sync/trainer_blocked_s"] = time.monotonic() - start
        _log_loads(self.log, loads)
        return metrics

    def collect(self, wait: bool = False) -> dict[str, float]:
        return {}

    def close(self) -> None:
        if self.snapshots:
            self.snapshots.close()


class Snapshots:
    """Push mode's copies of the pushed versions in the store, the newest two kept: what a replica restarted
    between two syncs loads."""

    def __init__(self, root: str) -> None:
        self.root, self.written = root, []

    def write(self, trainer, version: int, metrics: dict[str, float]) -> str:
        start = time.monotonic()
        url = f"{self.root}/snapshot-{version:06d}.safetensors"
        ray.get(trainer.publish_weights.remote(url))
        self.written.append(url)
        fs, _ = fsspec.core.url_to_fs(url)
        while len(self.written) > 2:  # a replica may be loading the one before
            old = self.written.pop(0)
            if fs.exists(old):
                fs.rm(old)
        metrics["sync/snapshot_s"] = time.monotonic() - start
        return url

    def close(self) -> None:
        if self.root.startswith("/dev/shm/"):
            shutil.rmtree(self.root, ignore_errors=True)


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
        seq, window = ray.get(self.clock.publish.remote(version, url))
        self.pending.append(seq)
        self.published.append(url)
        self._prune()
        return {**sent, **window, "sync/trainer_blocked_s": time.monotonic() - start}

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
            loads = [a for a in acks if isinstance(a, Loaded)]  # a replica that was already newer skips the message
            _log_loads(self.log, loads)
            if loads:
                metrics["sync/engine_paused_s"] = max(a.paused_s for a in loads)
                metrics["rollouter/idle_ratio"] = idle_ratio([a.busy for a in loads])
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
    # A restarted replica needs the current version's weights, which only the store can give it in push mode.
    snapshots = store_root(cfg.weight_sync.store, run_dir) if cfg.rollout.engine_max_restarts > 0 else ""
    ro = cfg.rollout
    timeout_s = cfg.weight_sync.connect_timeout_s
    return Push(trainer, clock, ro.num_replicas, run_dir, snapshots, timeout_s, ro.tensor_model_parallel_size)


def _log_loads(path: Path, loads: list[Loaded]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for a in loads:
            f.write(
                json.dumps(
                    {
                        "replica": a.replica,
                        "version": a.version,
                        "loaded_at": a.loaded_at,
                        "engine_ranks": a.engine_ranks,
                    }
                )
                + "\n"
            )
