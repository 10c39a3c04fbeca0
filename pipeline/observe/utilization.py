"""verl's dynamic_resource/* utilization metrics (fully_async_policy, with dynamic resource scheduling off) and the
trainer's fully_async/trainer/idle_ratio, one value per weight sync:

- `rollout_resource_utilization`: the time-weighted share of verl's max_concurrent_samples in use over the rollout's
  version window (from one sync's resumption to the next): sum(dt * min(active, S)) / sum(dt * S), `active` the
  prompts admitted and not yet generated (verl's active tasks), S the bound.
- `train_resource_utilization`: the trainer's compute seconds over its allocated seconds, each summed over the steps
  of a window: compute is the trainer's step (`timing/train_s`: log-probs and the update; the reward and the
  advantages are computed in the stream here, not on the trainer), allocated runs from the wait for the step's batch
  to the end of its sync. verl sums the steps it aggregated when the sync is logged: a sync step's own times are
  recorded after that, so they count in the next window, and the first sync of a run with
  trigger_parameter_sync_step=1 has no window (nothing is logged).
- `resource_utilization`: the two weighted by the devices each side holds, (a * train + b * rollout) / (a + b), a the
  trainer's ranks and b the engines' (their GPUs on a GPU cluster).
- `fully_async/trainer/idle_ratio`: the trainer's wait for data over its step time, each summed over the same steps
  (verl's timing_s/gen over timing_s/step; the per-step `trainer/idle_ratio` is wait over wait + train).

and the rollouter's `fully_async/rollouter/*`, which verl logs at every sync, the first too (RolloutIdle).
"""

from __future__ import annotations

PREFIX = "dynamic_resource/"
ROLLOUT = PREFIX + "rollout_resource_utilization"
ROLLOUTER = "fully_async/rollouter/"


class Occupancy:
    """The time integral of the prompts generating at once against verl's bound on them (the clock keeps one)."""

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.active, self.since = 0, now
        self.used = self.offered = 0.0  # prompt-seconds in use, and offered by the bound

    def change(self, active: int, now: float) -> None:
        """The prompts generating changed to `active` at `now`."""
        dt = max(0.0, now - self.since)
        self.used += dt * min(self.active, self.capacity)
        self.offered += dt * self.capacity
        self.active, self.since = active, now

    def close(self, now: float) -> float:
        """The window's utilization, up to `now` (0.0 for an empty window, as verl); the next window starts."""
        self.change(self.active, now)
        share = self.used / self.offered if self.offered > 0 else 0.0
        self.used = self.offered = 0.0
        return share


class RolloutIdle:
    """verl's rollouter idle ratio over a version window (from one sync's resumption to the next). The rollouter is
    idle from the moment it has nothing generating and its staleness budget admits nothing more (verl's processor,
    drained, waiting for the sync); `active_time` runs from the window's start to the last such moment, or is the
    whole window if there was none, and `idle_ratio` is 1 - active_time / version_time (1 for a window idle from its
    start). This counts only the wait for a sync; `rollouter/idle_ratio` (stages/engine_busy.py) counts every
    engine's idle time. `step_generated_samples`: the prompts whose responses were generated in the window (verl
    counts a prompt's group as one sample)."""

    def __init__(self, now: float) -> None:
        self._open(now)

    def _open(self, now: float) -> None:
        self.start = now
        self.idle_since: float | None = None  # the current idle stretch's start, if idle now
        self.last_idle = float("-inf")  # the window's last idle stretch's start
        self.generated = 0

    def update(self, idle: bool, now: float) -> None:
        """The rollouter is `idle` (or not) from `now` on."""
        if idle and self.idle_since is None:
            self.idle_since = self.last_idle = now
        elif not idle:
            self.idle_since = None

    def close(self, now: float) -> dict[str, float]:
        """The window's metrics, up to `now`; the next window starts, not idle until update says so."""
        version_s = max(now - self.start, 1e-6)
        went_idle = self.last_idle >= self.start  # verl's `>`: its processor notices a spent budget just after
        active_s = self.last_idle - self.start if went_idle else version_s
        out = {
            ROLLOUTER + "active_time": active_s,
            ROLLOUTER + "version_time": version_s,
            ROLLOUTER + "idle_ratio": 1 - active_s / version_s if went_idle else 0.0,
            ROLLOUTER + "step_generated_samples": float(self.generated),
        }
        self._open(now)
        return out


class ResourceUtilization:
    """The driver's side: the trainer's seconds per window, and the combination at each sync."""

    def __init__(self, trainer_devices: int, rollout_devices: int) -> None:
        self.trainer_devices, self.rollout_devices = trainer_devices, rollout_devices
        self.compute_s = self.allocated_s = self.wait_s = 0.0
        self.steps = 0

    def step(self, metrics: dict[str, float], allocated_s: float, synced: bool) -> dict[str, float]:
        """Account for a finished step (its `metrics` row so far, the wall seconds it held the trainer); at a sync,
        the window's metrics, which take the clock's rollout utilization out of `metrics` (verl logs it only beside
        the trainer's)."""
        out: dict[str, float] = {}
        if synced:
            rollout = metrics.pop(ROLLOUT, None)
            out = self._window(rollout)
            self.compute_s = self.allocated_s = self.wait_s = 0.0
            self.steps = 0
        self.compute_s += metrics["timing/train_s"]
        self.allocated_s += allocated_s
        self.wait_s += metrics["trainer/wait_s"]
        self.steps += 1
        return out

    def _window(self, rollout: float | None) -> dict[str, float]:
        if not self.steps:
            return {}
        out = {PREFIX + "train_compute_time_s": self.compute_s, PREFIX + "train_allocated_time_s": self.allocated_s}
        devices = self.trainer_devices + self.rollout_devices
        if self.allocated_s <= 0:
            return out
        train = self.compute_s / self.allocated_s
        out[PREFIX + "train_resource_utilization"] = train
        out["fully_async/trainer/idle_ratio"] = self.wait_s / self.allocated_s
        if rollout is not None and devices > 0:
            out[ROLLOUT] = rollout
            out[PREFIX + "resource_utilization"] = (
                self.trainer_devices * train + self.rollout_devices * rollout
            ) / devices
        return out
