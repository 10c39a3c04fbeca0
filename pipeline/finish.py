"""The end of a run: the gate's ledger to disk, the stream stopped, the logs audited, the summary printed and
handed to the monitor; or, when the user interrupts it, what was done and how to go on."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline import checkpoint
from pipeline.config import ConfigError
from pipeline.observe.audit import audit
from pipeline.observe.faults import FaultLog
from pipeline.observe.summary import format_summary, summarize
from pipeline.tasks.source import PromptDataError
from schemas import ADMITTED_SCHEMA
from stages import ray_internals


def finish_run(ctx, clock, sink) -> dict[str, Any]:
    """Write the gate's ledger, stop the stream, audit the logs, print the summary and hand the audit and summary
    to the monitor, which then ends the run as finished. Ray is stopped last, by the caller: the shorter the time
    between ray.shutdown() and the end of the process, the less a stray library thread can run into it."""
    ray.get(clock.close.remote())
    admissions = ray.get(clock.admissions.remote())
    pq.write_table(
        pa.table(
            {
                "prompt_id": [a[0] for a in admissions],
                "admitted_version": [a[1] for a in admissions],
                "admitted_time": [a[2] for a in admissions],
            },
            schema=ADMITTED_SCHEMA,
        ),
        ctx.run_dir / "admitted.parquet",
    )
    outstanding = ray.get(clock.stats.remote())["outstanding"]
    sink.finish()
    sink.close()
    ray_internals.wait_for_data_threads()  # before ray.shutdown(): see there
    report = audit(ctx.run_dir)
    (ctx.run_dir / "audit.txt").write_text(report.table() + "\n")
    summary = summarize(ctx.run_dir, report)
    summary["prompts_outstanding_in_clock"] = outstanding
    summary["prompts_buffered_unconsumed"] = len(sink.leftover())
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary, report), flush=True)
    ctx.monitor.log_artifacts([ctx.run_dir / "summary.json", ctx.run_dir / "audit.txt"])
    ctx.monitor.close("FINISHED")
    return summary


class RunFailed(RuntimeError):
    """A part of the run died and the run cannot go on; the message names it and what to do."""


def trainer_death(err: BaseException, trainer) -> str | None:
    """What died, if `err` says the trainer actor (or, through its calls, one of its ranks) died; else None."""
    if trainer is None:
        return None
    if isinstance(err, ray.exceptions.RayActorError) and err.actor_id == ray_internals.actor_id(trainer):
        # An error raised in its constructor is a failed start, which a restart would repeat: reported as it is.
        return None if err.actor_init_failed else "the trainer actor died"
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, ray.exceptions.RayActorError):
        return f"a trainer rank died ({type(err.cause).__name__})"
    return None


def restart_or_raise(ctx, err: Exception, restarts: int, trainer=None):
    """After `err` ended an attempt: the config of the next attempt if `trainer` (the attempt's trainer actor) died
    and can restart from a checkpoint; else bad input as it is (the CLI reports it as at start-up), or RunFailed
    naming what failed."""
    if isinstance(err, (ConfigError, PromptDataError)):
        raise err
    cause = trainer_death(err, trainer)
    if cause is None:
        raise failure(ctx, err) from err
    return restart_from_checkpoint(ctx, cause, restarts)


def restart_from_checkpoint(ctx, cause: str, restarts: int):
    """The config of the next attempt, which resumes this run directory from its latest checkpoint (as resume=true
    would); RunFailed unless it can: checkpoints on, one written, and `trainer.max_restarts` not spent."""
    t = ctx.cfg.trainer
    if t.save_freq <= 0:
        raise RunFailed(
            f"{cause} and this run keeps no checkpoint to restart it from: set trainer.save_freq (a multiple of "
            "trigger_parameter_sync_step) and the run restarts its trainer from the latest checkpoint by itself "
            "(trainer.max_restarts), or can be resumed with resume=true"
        )
    try:
        ckpt = checkpoint.latest(ctx.checkpoint_root)
    except checkpoint.ResumeError:
        raise RunFailed(f"{cause} before the first checkpoint (trainer.save_freq={t.save_freq}): start again") from None
    if restarts >= t.max_restarts:
        raise RunFailed(
            f"{cause}; the trainer was already restarted {restarts} times (trainer.max_restarts={t.max_restarts}). "
            f"Resume from step {ckpt.step} with resume=true trainer.run_name={ctx.run_dir.name}"
        )
    FaultLog(ctx.run_dir).write({"component": "trainer", "time": time.time(), "cause": cause, "from_step": ckpt.step})
    return dataclasses.replace(
        ctx.cfg,
        resume=True,
        trainer=dataclasses.replace(t, run_name=ctx.run_dir.name, output_dir=str(ctx.run_dir.parent)),
    )


def failure(ctx, err: BaseException) -> RunFailed:
    """The run failed for a reason no restart covers: the traceback to error.txt, and one line that names the
    part of the run that failed (a Ray task's or actor's name) and the innermost error."""
    import traceback

    (ctx.run_dir / "error.txt").write_text("".join(traceback.format_exception(err)))
    where, inner = "the driver", err
    while True:
        if isinstance(inner, ray.exceptions.RayTaskError):
            # Ray's RayTaskError(<cause's class>) forwards unknown attributes to its cause and may lack the name
            where = getattr(inner, "function_name", None) or where
        elif isinstance(inner, ray.exceptions.RayActorError) and inner.actor_init_failed:
            where = "an actor's constructor"  # Ray keeps only the text of its error: the last line names it
        nxt = getattr(inner, "cause", None) or inner.__cause__
        if nxt is None or nxt is inner:
            break
        inner = nxt
    what = (str(inner).strip().splitlines() or [""])[-1][:300]
    return RunFailed(f"{where} failed: {type(inner).__name__}: {what} (traceback: {ctx.run_dir}/error.txt)")


class RunInterrupted(KeyboardInterrupt):
    """The user stopped the run (Ctrl-C); the message says where it stopped and how to go on."""


def interrupted(ctx) -> RunInterrupted:
    """Ctrl-C: write what was done to summary.json, end the monitor's run as KILLED, and say how to resume."""
    rows = [json.loads(line) for line in (ctx.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1] if rows else {}
    try:
        ckpt = checkpoint.latest(ctx.checkpoint_root)
    except checkpoint.ResumeError:
        ckpt = None
    summary = {
        "run_dir": str(ctx.run_dir),
        "interrupted": True,
        "steps": len(rows),
        "last_step": int(last.get("step", 0)),
        "version": int(last.get("trainer/version", ctx.start_version)),
        "reward_last": last.get("reward/mean"),
        "resumable_from_step": ckpt.step if ckpt else None,
    }
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    ctx.monitor.log_artifacts([ctx.run_dir / "summary.json"])
    ctx.monitor.close("KILLED")
    where = f"interrupted at step {summary['last_step']} (version {summary['version']}); {ctx.run_dir}/summary.json"
    if ckpt is None:
        how = "no checkpoint to resume from: set trainer.save_freq (a multiple of trigger_parameter_sync_step)"
    else:
        how = f"resume from step {ckpt.step} with resume=true trainer.run_name={ctx.run_dir.name}"
    return RunInterrupted(f"{where}; {how}")
