"""Checkpoints and exact resume of an asynchronous run.

A checkpoint is taken at a sync step (its step is a multiple of `trigger_parameter_sync_step`), so the trainer's
weights are exactly the engines' weights of that version and a resumed engine can start from them labelled with
it. Layout under `trainer.checkpoint_dir` (any fsspec URL; default `<run_dir>/checkpoints`), verl's names:

    global_step_<S>/model/          HF model directory (weights, config, tokenizer) of version S / k
    global_step_<S>/optimizer.pt    the optimizer state
    global_step_<S>/state.json      step, version, gate counters
    global_step_<S>/ledger.parquet  the gate's admissions of every prompt consumed up to step S: the data cursor
    latest_checkpointed_iteration.txt   S, written last: a checkpoint is complete once this names it

Resume (`resume=true`) takes the latest complete checkpoint and rewinds the run directory to it: what the dead
attempt consumed after step S is retrained, so its consumption records and metrics move to
`discarded/attempt-<n>/`, and so do its samples of prompts not consumed by step S (they were in flight, or
trained after S). The gate then admits every prompt of the run's admission order that the ledger does not hold,
each exactly once (the clock refuses a second admission of a ledger entry), and step numbers continue at S + 1.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from schemas import ADMITTED_SCHEMA

LATEST = "latest_checkpointed_iteration.txt"


class ResumeError(ValueError):
    """Nothing to resume from; the message names the path and the fix."""


@dataclass
class Checkpoint:
    url: str  # global_step_<S> directory
    step: int
    version: int
    ledger: pa.Table  # ADMITTED_SCHEMA rows of the prompts consumed up to `step`


def root_of(checkpoint_dir: str, run_dir: Path) -> str:
    return (checkpoint_dir or str(run_dir / "checkpoints")).rstrip("/")


def has_checkpoint(root: str) -> bool:
    fs, path = fsspec.core.url_to_fs(root)
    return fs.exists(f"{path}/{LATEST}")


def resolve_auto_resume(cfg) -> None:
    """verl's trainer.resume_mode=auto: continue trainer.run_name from its latest checkpoint when there is one (set
    `resume`), else start it fresh; a run without a name is always fresh."""
    if cfg.trainer.resume_mode != "auto" or not cfg.trainer.run_name:
        return
    run_dir = Path(cfg.trainer.output_dir).resolve() / cfg.trainer.run_name
    cfg.resume = has_checkpoint(root_of(cfg.trainer.checkpoint_dir, run_dir))


def step_url(root: str, step: int) -> str:
    return f"{root}/global_step_{step}"


def commit(root: str, step: int, version: int, consumed: list[tuple[str, int, float]], gate: dict) -> None:
    """Finish a checkpoint whose model and optimizer the trainer has written: state, ledger, then the marker.

    `consumed` is the clock's ledger of the prompts consumed so far: (prompt_id, admitted_version, admitted_time).
    """
    ledger = pa.table({name: [row[i] for row in consumed] for i, name in enumerate(ADMITTED_SCHEMA.names)})
    fs, path = fsspec.core.url_to_fs(root)
    step_path = f"{path}/global_step_{step}"
    fs.makedirs(step_path, exist_ok=True)
    with fs.open(f"{step_path}/ledger.parquet", "wb") as f:
        pq.write_table(ledger.cast(ADMITTED_SCHEMA), f)
    with fs.open(f"{step_path}/state.json", "w") as f:
        json.dump({"step": step, "version": version, "gate": gate, "consumed_prompts": ledger.num_rows}, f)
    with fs.open(f"{path}/{LATEST}", "w") as f:
        f.write(str(step))


def latest(root: str) -> Checkpoint:
    fs, path = fsspec.core.url_to_fs(root)
    marker = f"{path}/{LATEST}"
    if not fs.exists(marker):
        raise ResumeError(
            f"resume=true found no checkpoint in {root} (no {LATEST}). Checkpoints are written every "
            f"trainer.save_freq steps; start without resume, or point trainer.checkpoint_dir at the run's checkpoints."
        )
    with fs.open(marker, "r") as f:
        step = int(f.read().strip())
    with fs.open(f"{path}/global_step_{step}/state.json", "r") as f:
        state = json.load(f)
    with fs.open(f"{path}/global_step_{step}/ledger.parquet", "rb") as f:
        ledger = pq.read_table(f)
    return Checkpoint(step_url(root, step), step, int(state["version"]), ledger)


def fetch(ckpt: Checkpoint, run_dir: Path) -> tuple[Path, Path]:
    """Local paths of the checkpoint's model directory and optimizer state (downloaded when remote)."""
    fs, path = fsspec.core.url_to_fs(ckpt.url)
    if isinstance(fs, LocalFileSystem):
        local = Path(path)
    else:
        local = run_dir / "resume" / Path(path).name
        fs.get(path, str(local), recursive=True)
    return local / "model", local / "optimizer.pt"


def rewind(run_dir: Path, ckpt: Checkpoint) -> dict[str, int]:
    """Move everything the dead attempt did after the checkpoint to discarded/attempt-<n>/; returns counts."""
    attempt = 1 + sum(1 for _ in (run_dir / "discarded").glob("attempt-*")) if (run_dir / "discarded").exists() else 1
    dest = run_dir / "discarded" / f"attempt-{attempt}"
    dest.mkdir(parents=True)
    kept = set(ckpt.ledger["prompt_id"].to_pylist())
    moved_steps = _rewind_consumed(run_dir / "consumed", dest / "consumed", ckpt.step)
    # groups dynamic sampling left out while a later step filled: their prompts are outstanding again
    _rewind_consumed(run_dir / "filtered", dest / "filtered", ckpt.step)
    moved_samples = _rewind_samples(run_dir / "samples", dest / "samples", kept)
    moved_metrics = _rewind_metrics(run_dir / "metrics.jsonl", dest / "metrics.jsonl", ckpt.step)
    for name in ("admitted.parquet", "summary.json", "audit.txt"):  # the dead attempt's, if it got that far
        if (run_dir / name).exists():
            shutil.move(run_dir / name, dest / name)
    return {"consumed_steps": moved_steps, "samples": moved_samples, "metrics_rows": moved_metrics}


def _rewind_consumed(src: Path, dest: Path, step: int) -> int:
    moved = 0
    for shard in sorted(src.glob("step-*.parquet")) if src.exists() else []:
        if int(shard.stem.split("-")[1]) > step:
            dest.mkdir(parents=True, exist_ok=True)
            shutil.move(shard, dest / shard.name)
            moved += 1
    return moved


def _rewind_samples(src: Path, dest: Path, kept_prompts: set[str]) -> int:
    """Split each shard into samples of prompts consumed by the checkpoint (kept) and the rest (discarded). A shard
    the dead attempt was still writing is a temporary file (stages.sample_log.write_shard) whose block never
    reached the trainer: its prompts are outstanding and admitted again, so the file goes."""
    for staged in src.glob("_*.tmp") if src.exists() else []:
        staged.unlink()
    moved = 0
    for shard in sorted(src.glob("*.parquet")) if src.exists() else []:
        table = pq.read_table(shard)
        keep = pa.array([pid in kept_prompts for pid in table["prompt_id"].to_pylist()], pa.bool_())
        if keep.true_count == table.num_rows:
            continue
        dest.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.filter(pc.invert(keep)), dest / shard.name)
        moved += table.num_rows - keep.true_count
        if keep.true_count:
            pq.write_table(table.filter(keep), shard.with_name(f"{shard.stem}-kept.parquet"))
        shard.unlink()
    return moved


def _rewind_metrics(src: Path, dest: Path, step: int) -> int:
    if not src.exists():
        return 0
    lines = src.read_text().splitlines()
    keep = [line for line in lines if json.loads(line)["step"] <= step]
    dest.write_text("".join(f"{line}\n" for line in lines if json.loads(line)["step"] > step))
    src.write_text("".join(f"{line}\n" for line in keep))
    return len(lines) - len(keep)


def save(root: str, trainer, clock, step: int, version: int) -> dict[str, float]:
    """Take a checkpoint right after the sync of `step`: trainer files first, then the commit (a crash in between
    leaves the previous checkpoint as the latest)."""
    import ray

    start = time.monotonic()
    ray.get(trainer.save_checkpoint.remote(step_url(root, step)))
    consumed = ray.get(clock.admissions.remote(consumed_only=True))
    commit(root, step, version, consumed, ray.get(clock.stats.remote()))
    return {"checkpoint/save_s": time.monotonic() - start}
