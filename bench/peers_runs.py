"""bench.peers' runs: one system on one workload in a process of its own, timed from its launch.

Each run is a child process: `asyncrl run` (this checkout, this venv) or bench/peers_trl.py (TRL's GRPOTrainer, in
its own virtualenv). Both are timed by the wall clock from the moment the child is launched, so start-up (imports,
Ray, the engine, model loading) counts as a user waits for it. While a run lasts, a thread sums the proportional
set size (PSS: shared pages split among the processes sharing them, so Ray's object store and vLLM's shared memory
count once) of the child and all its descendants every 3 seconds (a read costs ~3 ms of CPU per process: asyncrl's
~25 processes every second would take 7 % of a core from it); the run's peak memory is the largest sum.

Per step each run yields (step, seconds since launch, mean reward, trained tokens): asyncrl's from its metrics.jsonl
(`timing/elapsed_s` counted from the line its driver prints just before the loop starts, `reward/mean`,
`response_length/mean` x samples), TRL's from the JSON lines its callback writes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from bench.peers_workloads import Workload, trl_config

ROOT = Path(__file__).resolve().parents[1]
# The line the asyncrl driver prints just before its loop's clock starts (pipeline/run.py).
LOOP_LINE = re.compile(r"^asyncrl: .*, \d+ steps, run dir (?P<run_dir>\S+)")
ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Run:
    """One run's record: its steps as (step, s since launch, reward, trained tokens), its peak PSS, how it ended."""

    system: str
    workload: str
    steps: list[tuple[int, float, float, float]] = field(default_factory=list)
    peak_bytes: int = 0
    wall_s: float = 0.0
    returncode: int = 0
    log: str = ""
    load: tuple[float, float] = (0.0, 0.0)  # the machine's 1-minute load average at launch and at the end


class TreeMemory:
    """Samples the PSS of a process and its descendants every `interval_s` in a thread; `peak` is the largest sum."""

    def __init__(self, pid: int, interval_s: float = 3.0) -> None:
        self.root, self.interval_s, self.peak = psutil.Process(pid), interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            total = 0
            try:
                procs = [self.root, *self.root.children(recursive=True)]
            except psutil.Error:
                return
            for proc in procs:
                try:
                    total += proc.memory_full_info().pss
                except psutil.Error:  # ended between the listing and the read
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def launch(run: Run, cmd: list[str], on_line=None) -> float:
    """Run cmd to its end with its output in run.log, each line after the seconds since launch it came at;
    on_line(line, those seconds) sees each line as it comes.
    Fills run's exit code, wall seconds, peak PSS and load; returns the launch time (time.time())."""
    started, load = time.time(), os.getloadavg()[0]
    log_path = run.log
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env={**os.environ, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        memory = TreeMemory(proc.pid)
        for line in proc.stdout:
            at = time.time() - started
            log.write(f"{at:8.2f} {line}")  # each line stamped: where start-up goes, from the log alone
            if on_line:
                on_line(line, at)
        run.returncode = proc.wait()
    run.wall_s, run.peak_bytes, run.load = time.time() - started, memory.stop(), (load, os.getloadavg()[0])
    return started


def run_asyncrl(w: Workload, out: Path, name: str, extra: list[str], system: str = "asyncrl") -> Run:
    """`asyncrl run` of the workload (conf/default.yaml plus its overrides, then `extra`), metrics to JSONL only."""
    loop = {}

    def on_line(line: str, at: float) -> None:
        match = LOOP_LINE.match(line)
        if match and "t" not in loop:
            loop.update(t=at, run_dir=Path(match["run_dir"]))

    cmd = [sys.executable, "-m", "pipeline.cli", "run", *w.asyncrl_overrides, *extra]
    cmd += ["trainer.monitor=jsonl", f"trainer.output_dir={out}", f"trainer.run_name={name}"]
    run = Run(system, w.name, log=str(out / f"{name}.log"))
    launch(run, cmd, on_line)
    if "t" not in loop or not (loop["run_dir"] / "metrics.jsonl").exists():
        return run
    for line in (loop["run_dir"] / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        tokens = row["response_length/mean"] * w.samples_per_step
        run.steps.append((row["step"], loop["t"] + row["timing/elapsed_s"], row["reward/mean"], tokens))
    return run


def run_trl(w: Workload, out: Path, name: str, python: Path, threads: int) -> Run:
    """bench/peers_trl.py on the workload with TRL's python; its step lines are stamped with the wall clock."""
    steps_file = out / f"{name}.steps.jsonl"
    spec = {
        "model": str(w.model_dir),
        "prompts": str(w.prompts_jsonl),
        "reward": w.reward,
        "threads": threads,
        "samples_per_step": w.samples_per_step,
        "out": str(steps_file),
        "output_dir": str(out / name),
        "config": trl_config(w),
    }
    (out / f"{name}.spec.json").write_text(json.dumps(spec, indent=1))
    run = Run("TRL", w.name, log=str(out / f"{name}.log"))
    started = launch(run, [str(python), str(ROOT / "bench" / "peers_trl.py"), str(out / f"{name}.spec.json")])
    if steps_file.exists():
        for line in steps_file.read_text().splitlines():
            row = json.loads(line)
            if "step" in row:
                run.steps.append((row["step"], row["t"] - started, row["reward"], row["completion_tokens"]))
    return run
