"""Where the cores go: one run of a job, its processes' CPU time sampled every second, in cores per kind of process
over the run's steady steps.

On one machine the engine, the trainer and the stream's own processes share the cores, so a side's idle ratio says
little by itself: a trainer that waits may be waiting for an engine that has too few cycles, because the stream's
bookkeeping takes them. This prints what each kind of process used while the run trained steps `--skip`+1 to the
last `--skip`: the vLLM worker that runs the model, the engine core (vLLM's scheduler process), the Generate actor
that hosts the engine and the agent loops, the trainer, the stream's other stage actors, the driver (Ray Data's
executor, the gate's calls, the sink) and Ray's own daemons. Only this process and its descendants are counted.

    python -m bench.cpu_share                              # the embedded job (`make run`), about 4 minutes
    python -m bench.cpu_share conf/multi_turn.yaml async_training.partial_rollout=true
    python -m bench.cpu_share --smoke                      # seconds, on the simulated toy workload (bench/smoke.py)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import psutil
import pyarrow.dataset as pds

from bench.smoke import SIM_TOY, TINY
from pipeline.config import DEFAULT_CONFIG, load_config

# First match wins: the command line of each process (Ray and vLLM set their processes' titles) against these.
KINDS = [
    ("VLLM::Worker", "vLLM worker (the model)"),
    ("VllmWorker", "vLLM worker (the model)"),
    ("EngineCore", "vLLM engine core (scheduler; with one CPU rank also the model)"),
    ("multiprocessing.forkserver", "the engine core's forkserver (start-up)"),
    ("VLLMGenerate", "Generate actor (engine client)"),
    ("Trainer", "trainer"),
    ("StalenessGate", "gate actor"),
    ("MapWorker", "reward/advantage/log actors"),
    ("DashboardAgent", "Ray daemons"),
    ("RuntimeEnvAgent", "Ray daemons"),
    ("ray::", "control actors and tasks"),  # the version clock, Ray Data's stats actor, the prompt reads
    ("site-packages/ray/", "Ray daemons"),  # raylet, gcs_server, dashboard, log monitor
]
DRIVER = "driver (Ray Data, gate, sink)"


def kind_of(cmdline: str) -> str:
    return next((kind for pattern, kind in KINDS if pattern in cmdline), "other")


class Sampler(threading.Thread):
    """CPU seconds per kind of process, every `period_s`, for this process and its descendants."""

    def __init__(self, period_s: float = 1.0) -> None:
        super().__init__(daemon=True, name="cpu-sampler")
        self.period_s, self.samples = period_s, []  # (time, {kind: CPU seconds since the previous sample})
        self.stopped = threading.Event()
        self.root = psutil.Process()

    def _totals(self) -> dict[int, tuple[str, float]]:
        found = {self.root.pid: (DRIVER, self._cpu(self.root))}
        for proc in self.root.children(recursive=True):
            try:
                found[proc.pid] = (kind_of(" ".join(proc.cmdline())), self._cpu(proc))
            except psutil.Error:  # ended between the listing and the read
                continue
        return found

    @staticmethod
    def _cpu(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    def run(self) -> None:
        before = self._totals()
        while not self.stopped.wait(self.period_s):
            now = self._totals()
            used = collections.Counter()
            for pid, (kind, cpu) in now.items():  # a new process counts from its first sample on
                used[kind] += cpu - before[pid][1] if pid in before else 0.0
            self.samples.append((time.time(), dict(used)))
            before = now


def cores_between(samples: Iterable[tuple[float, dict[str, float]]], begin: float, end: float) -> dict[str, float]:
    """Mean cores per kind over the samples taken in [begin, end)."""
    inside = [by_kind for t, by_kind in samples if begin <= t < end]
    used = collections.Counter()
    for by_kind in inside:
        used.update(by_kind)
    if len(inside) < 2:
        raise ValueError(f"fewer than two CPU samples between {begin:.1f} and {end:.1f}: make the run longer")
    span = end - begin
    return {kind: seconds / span for kind, seconds in used.most_common()}


def step_starts(run_dir: Path) -> dict[int, float]:
    """When each step took its first sample (the consumption log), in wall-clock seconds."""
    table = pds.dataset(str(run_dir / "consumed")).to_table(columns=["consumed_step", "consumed_time"])
    starts: dict[int, float] = {}
    for step, t in zip(table["consumed_step"].to_pylist(), table["consumed_time"].to_pylist(), strict=True):
        starts[step] = min(t, starts.get(step, t))
    return starts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="the job's YAML")
    parser.add_argument("overrides", nargs="*", help="key=value, as `asyncrl run` takes them")
    parser.add_argument("--skip", type=int, default=8, help="steps left out at the start and at the end (>= 1)")
    parser.add_argument("--smoke", action="store_true", help="seconds, on the simulated toy workload; figures void")
    args = parser.parse_args(argv)
    if args.smoke:  # 12 steps, sampled 10 times a second
        args.config, args.skip = SIM_TOY, 1
        args.overrides = [*TINY, "rollout.total_rollout_steps=48", "sim.time_scale=0.002", *args.overrides]
    if args.skip < 1:
        parser.error("--skip must be at least 1: the window ends where the step after it starts")
    from pipeline.run import run

    out = tempfile.mkdtemp(prefix="asyncrl-bench-cpu-share-")  # a trainer.output_dir among the overrides wins
    cfg = load_config(
        args.config,
        [f"trainer.output_dir={out}", "trainer.monitor=jsonl", "trainer.run_name=cpu-share", *args.overrides],
    )
    sampler = Sampler(period_s=0.1 if args.smoke else 1.0)
    sampler.start()
    summary = run(cfg)
    sampler.stopped.set()
    first, last = args.skip + 1, summary["steps"] - args.skip
    if last <= first:
        raise SystemExit(f"the run has {summary['steps']} steps: too few to leave out {args.skip} at each end")
    print(f"\n{args.config} {' '.join(args.overrides)}: steps {first}-{last}")
    return report(summary, sampler.samples, first, last)


def report(summary: dict, samples: list, first: int, last: int) -> dict[str, float]:
    """Prints the window's step time and cores per kind of process; returns the cores."""
    run_dir = Path(summary["run_dir"])
    starts = step_starts(run_dir)
    begin, end = starts[first], starts[last + 1]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_s = statistics.mean(r["timing/train_s"] for r in rows if first <= r["step"] <= last)
    print(f"{(end - begin) / (last + 1 - first):.2f} s per step, of which the trainer's own step {train_s:.2f} s")
    print("cores used per kind of process:")
    cores = cores_between(samples, begin, end)
    for kind, n in cores.items():
        print(f"  {kind:<32} {n:>5.2f}")
    print(f"  {'all of them':<32} {sum(cores.values()):>5.2f} of {psutil.cpu_count()} cores")
    print(
        f"trainer idle {summary['trainer_idle_ratio']:.2f}, engine idle {summary['rollouter_idle_ratio']:.2f}, "
        f"audit {'PASS' if summary['audit_ok'] else 'FAIL'}"
    )
    return cores


if __name__ == "__main__":
    main()
