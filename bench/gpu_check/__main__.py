"""Run the GPU check's pieces, each in a process of its own, and write their table.

    python -m bench.gpu_check                      # on a GPU: every piece, about 3 minutes on an H100
    python -m bench.gpu_check --device cpu --size tiny --jobs 2  # the CPU rehearsal (the test suite runs it)
    python -m bench.gpu_check --only transport,megatron  # some pieces

Writes OUT/results.json (every record) and OUT/table.md, prints the table, and exits 1 if any check failed or any
piece did not finish (its log, OUT/logs/<job>.log, says why; its tail is printed too). A piece is killed after
--timeout seconds, so the whole check fits the device's ten-minute commands piece by piece (`--only`). `--jobs N` runs
N processes at a time (the CPU rehearsal, where each is mostly one process's imports; on one GPU keep 1, the default,
so that each piece's time and peak memory are its own); a piece that reads another's rows runs after it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.gpu_check.report import Record, load, save, table

PIECES = ("torch", "megatron", "replay", "transport")


@dataclass
class Job:
    name: str  # its log's and its rows' file name
    module: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def jobs(device: str, size: str, out: Path, pieces: tuple[str, ...]) -> list[Job]:
    """The processes the check runs, in order; a later one may read an earlier one's rows (megatron's CPU path)."""
    gpu = device != "cpu"
    common = ["--device", device]
    plan: list[Job] = []
    if "torch" in pieces:
        for variant in ("single", "fsdp", "packed"):
            plan.append(Job(f"torch_{variant}", "trainer_step", common + ["--size", size, "--variant", variant]))
    if "megatron" in pieces:
        cpu_rows = str(out / "megatron_cpu.json")
        plan.append(Job("megatron_cpu", "megatron_step", ["--device", "cpu", "--size", size]))
        for dtype in ("fp32", "bf16") if gpu else ("fp32",):  # bf16 parameters need megatron's CUDA optimizer
            plan.append(
                Job(
                    f"megatron_{dtype}",
                    "megatron_step",
                    common + ["--size", size, "--dtype", dtype, "--reference", cpu_rows],
                )
            )
    if "replay" in pieces:
        for backend in ("torch", "megatron"):
            plan.append(Job(f"replay_{backend}", "replay", common + ["--backend", backend]))
    if "transport" in pieces:
        plan.append(Job("transport", "transport", common + ["--size", size]))
    return plan


def run_job(job: Job, out: Path, timeout_s: float) -> list[Record]:
    """The job's rows; a failing record naming it when it did not finish."""
    rows, log = out / f"{job.name}.json", out / "logs" / f"{job.name}.log"
    command = [sys.executable, "-m", f"bench.gpu_check.{job.module}", *job.args, "--out", str(rows)]
    env = os.environ | {"PYTHONUNBUFFERED": "1"} | job.env
    start = time.monotonic()
    with log.open("w") as f:
        try:
            code = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            code = -1
    if code == 0 and rows.exists():
        return load(rows)
    tail = log.read_text().splitlines()[-25:]
    print(f"--- {job.name} did not finish (exit {code}); the end of {log}:", *tail, sep="\n", flush=True)
    failed = Record(f"{job.name}: did not finish (logs/{job.name}.log)", "", time_s=time.monotonic() - start)
    failed.check("exit code (-1: timed out)", abs(code) or 1, 0)
    return [failed]


def lanes(plan: list[Job]) -> list[list[Job]]:
    """The plan cut into lanes that may run side by side: the megatron jobs in one (the later ones read the CPU
    step's rows), every other job alone."""
    megatron = [job for job in plan if job.name.startswith("megatron_")]
    return ([megatron] if megatron else []) + [[job] for job in plan if job not in megatron]


def run_lanes(plan: list[list[Job]], out: Path, timeout_s: float, workers: int) -> dict[str, list[Record]]:
    """Every lane's jobs one after the other, `workers` lanes at a time; each job's rows by its name."""

    def lane(jobs_in_lane: list[Job]) -> dict[str, list[Record]]:
        done = {}
        for job in jobs_in_lane:
            done[job.name] = run_job(job, out, timeout_s)
            print(table(done[job.name][-1:]).splitlines()[-1], flush=True)
        return done

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return {name: rows for result in pool.map(lane, plan) for name, rows in result.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (its rehearsal)")
    parser.add_argument("--size", default="gpu", choices=("gpu", "tiny"))
    parser.add_argument("--only", default=",".join(PIECES), help=f"comma-separated, of {', '.join(PIECES)}")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds a piece may take")
    parser.add_argument("--jobs", type=int, default=1, help="processes at a time (1 on a GPU)")
    args = parser.parse_args(argv)
    pieces = tuple(p for p in args.only.split(",") if p)
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        parser.error(f"--only: unknown pieces {unknown}; choose from {', '.join(PIECES)}")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    plan = jobs(args.device, args.size, args.out, pieces)
    done = run_lanes(lanes(plan), args.out, args.timeout, args.jobs)
    for job in plan:  # the table in the plan's order, whatever order the lanes ended in
        records += done[job.name]
    save(records, args.out / "results.json")
    text = table(records)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
