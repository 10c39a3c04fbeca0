"""`asyncrl plan`: which trainer:rollout split and staleness to run on a GPU budget, predicted by the event model.

Input: a run config whose `sim` section describes the workload (measured or assumed): the response-length
distribution, an engine of `sim.slots` sequences standing for `--sim-engine-gpus` GPUs at
`sim.decode_s_per_token`, a trainer that spends `sim.train_s_per_token` on `--sim-trainer-gpus` GPUs, and the
sync cost. Engines and trainer are assumed to scale linearly with GPUs (data parallel). Every candidate
(split x staleness x partial rollout, with the config's batch sizes and trigger_parameter_sync_step) runs through
pipeline/sim/des.py; so does the colocated synchronous baseline on all GPUs (the same trainer, `--switch-s` between
generating and training). The recommendation is the fastest candidate within `--max-staleness`.

The trainer's share is whole model replicas of the config's layout (Megatron: TP x PP GPUs each; the torch
backend: one), so each candidate is also a data-parallel size, and the recommendation names the keys that set it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pipeline.config import RunConfig
from pipeline.sim.des import Setting, simulate
from stages.staleness import StalenessBudget

STALENESS = (0.0, 0.25, 0.5, 1.0)
WINDOWS = 8  # sync windows simulated per candidate; the first is start-up and left out


@dataclass(frozen=True)
class Hardware:
    gpus: int
    gpus_per_replica: int = 8
    sim_engine_gpus: int = 8
    sim_trainer_gpus: int = 8
    switch_s: float | None = None  # colocated switch between generating and training; None: the sync time
    trainer_replica_gpus: int = 1  # GPUs of one trainer model replica (TP x PP): the trainer's share's step

    def __post_init__(self) -> None:
        if self.gpus < 2 * self.gpus_per_replica:
            raise ValueError(
                f"--gpus {self.gpus} leaves no room for a trainer beside one {self.gpus_per_replica}-GPU engine: "
                "raise --gpus or lower --gpus-per-replica"
            )


def replica_gpus(cfg: RunConfig) -> int:
    """GPUs of one trainer model replica: Megatron's TP x PP, the torch backend's one rank."""
    mg = cfg.actor.megatron
    return mg.tensor_model_parallel_size * mg.pipeline_model_parallel_size if cfg.trainer.backend == "megatron" else 1


@dataclass
class Candidate:
    trainer_gpus: int
    rollout_gpus: int
    staleness: float
    partial: str  # 'off', 'abort'
    step_s: float  # simulated seconds per trainer step, steady state
    trainer_idle: float
    rollouter_idle: float
    data_parallel: int = 1  # trainer model replicas


def _per_step(step_end: list[float], k: int) -> float:
    return (step_end[-1] - step_end[k - 1]) / (len(step_end) - k)


def _run(cfg: RunConfig, hw: Hardware, rollout_gpus: int, trainer_gpus: int, s: float, partial: str, switch: float):
    at = cfg.async_training
    budget = StalenessBudget(
        ppo_mini_batch_size=cfg.actor.ppo_mini_batch_size,
        require_batches=at.require_batches,
        trigger_parameter_sync_step=at.trigger_parameter_sync_step,
        staleness_threshold=s,
        concurrent_samples_per_replica=at.concurrent_samples_per_replica,
        replicas=max(1, rollout_gpus // hw.gpus_per_replica),
    )
    slots = max(1, round(cfg.sim.slots * rollout_gpus / hw.sim_engine_gpus))
    work = dataclasses.replace(
        cfg.sim,
        slots=slots,
        train_s_per_token=cfg.sim.train_s_per_token * hw.sim_trainer_gpus / trainer_gpus,
        sync_s=cfg.sim.sync_s if switch is None else switch,
        sync_bytes=cfg.sim.sync_bytes if switch is None else 0.0,
    )
    mode = "wait" if partial == "off" else partial
    setting = Setting(budget, cfg.rollout.n, cfg.data.max_response_length, slots, 2 * slots + cfg.rollout.n, mode)
    out = simulate(work, setting, WINDOWS * at.trigger_parameter_sync_step)
    return _per_step(out.step_end_s, at.trigger_parameter_sync_step), out


def colocated(cfg: RunConfig, hw: Hardware) -> float:
    """Seconds per step of the synchronous baseline: all GPUs generate, then all train."""
    switch = hw.switch_s if hw.switch_s is not None else cfg.sim.sync_time_s()
    step, _ = _run(cfg, hw, hw.gpus, hw.gpus, 0.0, "off", switch)
    return step


def candidates(cfg: RunConfig, hw: Hardware, max_staleness: float) -> list[Candidate]:
    out = []
    for rollout in range(hw.gpus - hw.gpus_per_replica, 0, -hw.gpus_per_replica):
        trainer_gpus = hw.gpus - rollout
        if trainer_gpus % hw.trainer_replica_gpus:  # the trainer runs whole model replicas
            continue
        for s in (x for x in STALENESS if x <= max_staleness):
            for partial in ("off", "abort") if s > 0 else ("off",):
                step, res = _run(cfg, hw, rollout, trainer_gpus, s, partial, None)
                idle = (res.trainer_idle_ratio, res.rollouter_idle_ratio)
                dp = trainer_gpus // hw.trainer_replica_gpus
                out.append(Candidate(trainer_gpus, rollout, s, partial, step, *idle, data_parallel=dp))
    if not out:
        raise ValueError(
            f"no split of --gpus {hw.gpus} gives the trainer whole {hw.trainer_replica_gpus}-GPU model replicas "
            f"beside {hw.gpus_per_replica}-GPU engines: change --gpus, --gpus-per-replica or the trainer's TP x PP"
        )
    return sorted(out, key=lambda c: c.step_s)


def report(cfg: RunConfig, hw: Hardware, max_staleness: float, top: int = 10) -> str:
    base = colocated(cfg, hw)
    ranked = candidates(cfg, hw, max_staleness)
    lines = [
        f"colocated sync on {hw.gpus} GPUs: {base:.1f} s per step (simulated)",
        f"{'trainer:rollout':>15} {'trainer DP':>10} {'staleness':>9} {'partial':>7} {'s/step':>8} {'speedup':>7} "
        f"{'trainer idle':>12} {'rollout idle':>12}",
    ]
    for c in ranked[:top]:
        lines.append(
            f"{f'{c.trainer_gpus}:{c.rollout_gpus}':>15} {c.data_parallel:>10} {c.staleness:>9} {c.partial:>7} "
            f"{c.step_s:>8.1f} {base / c.step_s:>7.2f} {c.trainer_idle:>12.2f} {c.rollouter_idle:>12.2f}"
        )
    best = ranked[0]
    lines.append(
        f"recommended: trainer {best.trainer_gpus} GPUs (data-parallel size {best.data_parallel} x "
        f"{hw.trainer_replica_gpus} GPUs per model replica: {_trainer_keys(cfg, best.trainer_gpus)}), "
        f"rollout {best.rollout_gpus} GPUs (rollout.num_replicas={best.rollout_gpus // hw.gpus_per_replica} of "
        f"{hw.gpus_per_replica} GPUs), async_training.staleness_threshold={best.staleness}, "
        f"async_training.partial_rollout={str(best.partial != 'off').lower()}: "
        f"predicted {base / best.step_s:.2f}x over colocated sync"
    )
    return "\n".join(lines)


def _trainer_keys(cfg: RunConfig, gpus: int) -> str:
    """The keys that give the trainer `gpus` ranks: verl's n_gpus_per_node x nnodes, and fsdp_size=-1 (all of
    them) for the torch backend."""
    per_node = max(d for d in range(1, 9) if gpus % d == 0)  # nodes of up to 8 GPUs, all alike
    nodes = f"trainer.n_gpus_per_node={per_node} trainer.nnodes={gpus // per_node}"
    return nodes if cfg.trainer.backend == "megatron" else f"{nodes} actor.fsdp_config.fsdp_size=-1"
