"""The whole fully-async loop: prompts -> gate -> generate -> reward -> advantage -> sample log -> trainer,
with a weight push to every engine each `trigger_parameter_sync_step` steps.

Generation runs ahead of training inside the stream for as long as the gate's staleness budget allows; the
trainer only ever waits for data (trainer/idle_ratio) and the engines only ever wait for permits or syncs.
"""

from __future__ import annotations

import os
import sys
import time

import ray
from tqdm import tqdm

from pipeline import checkpoint, sync
from pipeline.config import RunConfig
from pipeline.config.placement import devices
from pipeline.finish import finish_run, interrupted, restart_or_raise
from pipeline.observe.faults import FaultLog
from pipeline.observe.metrics import FullyAsyncCounters, step_metrics
from pipeline.observe.utilization import ResourceUtilization
from pipeline.prepare import Attempt, RunContext, prepare
from pipeline.stream import build_stream, configure_data_context, dynamic_sampling, placement, step_transform
from pipeline.trainer_launch import start_trainer
from pipeline.validate import make_validator
from stages import ray_internals
from stages.handoff import ByReference, TokenTables
from stages.sink import TrainingSink
from stages.staleness import StalenessBudget, mode_name


def run(cfg: RunConfig) -> dict:
    restarts = 0
    while True:
        ctx: RunContext = prepare(cfg)  # run dir, monitor, model (embedded + warm start), validated prompts, Ray
        attempt = Attempt(ctx)  # the actors this attempt starts, ended with it
        try:
            return _loop(cfg, ctx, attempt, restarts)
        except KeyboardInterrupt:
            raise interrupted(ctx) from None  # what was done, the monitor's run KILLED, how to resume
        except Exception as err:
            cfg = restart_or_raise(ctx, err, restarts, attempt.trainer)  # a dead trainer: resume from its checkpoint
            restarts += 1
        finally:
            attempt.shutdown()  # also on errors: a Ray we started must not outlive the run, the monitor marks it failed


def _loop(cfg: RunConfig, ctx: RunContext, attempt: Attempt, restarts: int) -> dict:
    at = cfg.async_training
    budget = StalenessBudget.from_config(cfg)
    clock = attempt.start_clock(budget)
    trainer = attempt.trainer = start_trainer(ctx, attempt)
    configure_data_context(cfg.ray.no_progress_timeout_s)
    tables = TokenTables.start(placement(cfg).head_resources())  # holds per-token tables until the driver takes them
    stream = build_stream(
        cfg, ctx.source, str(ctx.model_dir), str(ctx.run_dir), ctx.clock_handle, tables, ctx.start_version
    )
    sink = TrainingSink(
        ByReference(stream, tables),  # the driver fetches the light columns; the trainer fetches the per-token ones
        budget,
        cfg.rollout.n,
        str(ctx.run_dir / "consumed"),
        lambda v: ray.get(clock.outstanding_at_or_before.remote(v)),
        step_transform(cfg),  # reinforce_plus_plus*: whitened over the step, as verl does over its batch
        dynamic_sampling(cfg, clock, str(ctx.run_dir / "filtered"), ctx.start_step),  # DAPO's, when enabled
    )
    attempt.stream = sink  # closed before Ray stops, whatever ends the run
    monitor = ctx.monitor
    total_steps, k = cfg.rollout.total_rollout_steps // budget.required_samples, at.trigger_parameter_sync_step
    print(
        f"asyncrl: {mode_name(at.staleness_threshold, k, at.partial_rollout)}, {total_steps} steps, "
        f"run dir {ctx.run_dir}",
        flush=True,
    )
    version, started, counters = ctx.start_version, time.monotonic(), FullyAsyncCounters()
    utilization = ResourceUtilization(*devices(cfg))  # verl's dynamic_resource/*, at each sync
    faults = FaultLog(ctx.run_dir, restarts, ray.get(ray_internals.call_on_actor(trainer, lambda _: os.getpid())))
    syncer = sync.make_syncer(cfg, trainer, clock, ctx.run_dir)  # push (verl) or pull (a parameter store)
    validator = make_validator(cfg, ctx, clock, trainer)  # held-out prompts at sync points
    try:
        first = ctx.start_step + 1  # a resumed run continues the step numbering
        bar = tqdm(
            range(first, total_steps + 1),
            desc="train steps",
            unit="step",
            initial=first - 1,
            total=total_steps,
            disable=not sys.stderr.isatty(),  # in a log a bar is one endless line: the console monitor writes lines
        )
        for step in bar:
            step_started = time.monotonic()
            batch = sink.next_step(version, steps_left_after_this=k - 1 - (step - 1) % k)
            if batch is None:
                break
            if step == first and cfg.trainer.val_before_train:  # the stream runs now, so its replicas are starting
                validator.start(version)
            metrics = ray.get(trainer.train_step.remote(batch.minibatches(cfg.actor.ppo_mini_batch_size)))
            sink.record(batch, version, step)
            ids = [g["prompt_id"][0].as_py() for g in batch.groups]
            stats, clock_faults = ray.get(clock.step_done.remote(ids, faults.seen))  # consumed; the clock's counters
            metrics.update(
                step_metrics(batch, version, stats, metrics["timing/train_s"], kl_coef=cfg.algorithm.kl_ctrl.kl_coef)
            )
            metrics.update(counters.update(batch.table, version))
            metrics.update(faults.update(clock_faults))
            if step % k == 0:
                version += 1
                metrics.update(syncer.sync(version))
                counters.new_window()
                metrics.update(validator.after_sync(version))
            metrics.update(utilization.step(metrics, time.monotonic() - step_started, synced=step % k == 0))
            metrics.update(syncer.collect(wait=step == total_steps))  # pull mode: the replicas' loads, as they finish
            if cfg.trainer.save_freq > 0 and step % cfg.trainer.save_freq == 0:  # a sync step too (config check)
                metrics.update(checkpoint.save(ctx.checkpoint_root, trainer, clock, step, version))
            metrics.update(validator.collect(wait=step == total_steps))  # the passes that have finished
            metrics["timing/elapsed_s"] = time.monotonic() - started
            monitor.log(metrics, step)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.2f}", version=version, refresh=False)
    finally:
        syncer.close()  # pull mode: its weight files, also when the run fails
        validator.close()
    return finish_run(ctx, clock, sink)
