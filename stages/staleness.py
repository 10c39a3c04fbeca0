"""verl's staleness arithmetic, as pure functions (the gate, the sink and the audit all use these).

verl (fully_async_policy) counts, per weight version, the prompts the rollouter admitted plus those carried over
from earlier versions that the trainer has not consumed yet, and pauses generation when that count reaches

    max_required_samples = required_samples * (1 + staleness_threshold) * trigger_parameter_sync_step
    required_samples     = ppo_mini_batch_size * require_batches

At a sync the count restarts at the number of prompts admitted but not yet consumed. We keep exactly that rule, and
verl's exact arithmetic: `int(required_samples * (staleness_threshold + 1) * trigger_parameter_sync_step)`, evaluated
left to right in floats and truncated, so a verl config gets the same budget to the prompt even where float rounding
lands below an integer (mini-batch 100, s = 0.15, k = 1: 100 * 1.15 = 114.99999999999999, so 114, not 115).

verl also bounds the prompts generating at once: max_concurrent_samples = min(replicas *
concurrent_samples_per_replica, max_required_samples). Its rollouter counts a prompt when it takes it and only then
waits for a free slot, so one prompt more than that is admitted and unfinished while the slots are full; the gate
admits within the same `max_concurrent_samples + 1` (`concurrency_permits`), the prompts a replica has handed on
freeing their places.

verl does not bound the lag of a sample; we do, and the audit proves it from the logs. The trainer consumes
C = trigger_parameter_sync_step * required_samples prompts per version, and at most B = floor((1+s) C) are
outstanding. If the sink always trains on the oldest admitted prompts first, and makes sure none admitted at
version w - L is left when version w ends, then every sample's lag (consumer version - oldest token version) is
at most L = ceil(s) (L = 0 for s = 0): the carried-over backlog after L versions is at most B - L*C <= C, so it
always fits into the C prompts of the next version. Partial rollout does not change L: an interrupted response
keeps its admission version as its oldest token version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_EPS = 1e-9
CONCURRENT_SAMPLES_PER_REPLICA = 16  # verl's default (fully_async_ppo_trainer.yaml)


@dataclass(frozen=True)
class StalenessBudget:
    staleness_threshold: float
    trigger_parameter_sync_step: int
    require_batches: int
    ppo_mini_batch_size: int
    concurrent_samples_per_replica: int = CONCURRENT_SAMPLES_PER_REPLICA
    replicas: int = 1

    @classmethod
    def from_config(cls, cfg) -> StalenessBudget:
        """From a run config (the typed RunConfig or the YAML a run directory keeps): verl's key names. A run
        directory written before async_training.concurrent_samples_per_replica existed gets verl's default."""
        at = cfg.async_training
        per_replica = getattr(at, "concurrent_samples_per_replica", CONCURRENT_SAMPLES_PER_REPLICA)
        return cls(
            at.staleness_threshold,
            at.trigger_parameter_sync_step,
            at.require_batches,
            cfg.actor.ppo_mini_batch_size,
            per_replica,
            cfg.rollout.num_replicas,
        )

    @property
    def required_samples(self) -> int:
        """Prompts per trainer step."""
        return self.ppo_mini_batch_size * self.require_batches

    @property
    def consumed_per_version(self) -> int:
        """Prompts the trainer consumes between two weight syncs (C)."""
        return self.required_samples * self.trigger_parameter_sync_step

    @property
    def max_required_samples(self) -> int:
        """Most prompts admitted per version, carried-over ones included (B, verl's name)."""
        # verl's expression, in verl's order: the float product's truncation differs from the exact floor at times.
        return int(self.required_samples * (self.staleness_threshold + 1) * self.trigger_parameter_sync_step)

    @property
    def max_concurrent_samples(self) -> int:
        """Most prompts generating at once over all replicas (verl's name and expression)."""
        return min(self.replicas * self.concurrent_samples_per_replica, self.max_required_samples)

    def concurrency_permits(self, in_flight: int) -> int:
        """Prompts the gate may still admit while `in_flight` are admitted and not yet generated: verl's slots plus
        the one prompt its rollouter holds while it waits for a slot."""
        return max(0, self.max_concurrent_samples + 1 - in_flight)

    @property
    def lag_bound(self) -> int:
        """Largest lag a consumed sample may have: ceil(s), 0 when synchronous."""
        return math.ceil(self.staleness_threshold - _EPS) if self.staleness_threshold > 0 else 0

    def permits(self, admitted_in_version: int, carried_over: int) -> int:
        """Prompts the gate may still admit in the current version."""
        return max(0, self.max_required_samples - admitted_in_version - carried_over)

    def must_consume_now(self, outstanding_too_old: int, steps_left_after_this: int) -> int:
        """Prompts at risk of exceeding the lag bound that this step has to take.

        `outstanding_too_old` counts outstanding prompts admitted at version <= current - lag_bound: they must all
        be consumed before the next sync. Whatever the remaining steps of this version cannot absorb is due now.
        """
        return max(0, outstanding_too_old - steps_left_after_this * self.required_samples)


def mode_name(staleness_threshold: float, trigger_parameter_sync_step: int, partial_rollout: bool) -> str:
    """The four modes of verl's recipe, by their settings."""
    if staleness_threshold == 0:
        return "on_policy_pipeline" if trigger_parameter_sync_step == 1 else "stream_off_policy_pipeline"
    return "async_stream_partial_rollout" if partial_rollout else "async_stream_stale_samples"
