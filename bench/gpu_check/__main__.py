"""Run the GPU check's pieces, each in a process of its own, and write their table.

    python -m bench.gpu_check                      # on a GPU: every piece, about 3 minutes on an H100
    python -m bench.gpu_check --device cpu --size tiny   # the CPU rehearsal (the test suite runs it)
    python -m bench.gpu_check --only transport,megatron  # some pieces

Writes OUT/results.json (every record) and OUT/table.md, prints the table, and exits 1 if any check failed or any
piece did not finish (its log, OUT/logs/<job>.log, says why; its tail is printed too). A piece is killed after
--timeout seconds, so the whole check fits the device's ten-minute commands piece by piece (`--only`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
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
        for variant in ("single", "fsdp"):
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (its rehearsal)")
    parser.add_argument("--size", default="gpu", choices=("gpu", "tiny"))
    parser.add_argument("--only", default=",".join(PIECES), help=f"comma-separated, of {', '.join(PIECES)}")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"))
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds a piece may take")
    args = parser.parse_args(argv)
    pieces = tuple(p for p in args.only.split(",") if p)
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        parser.error(f"--only: unknown pieces {unknown}; choose from {', '.join(PIECES)}")
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    records: list[Record] = []
    for job in jobs(args.device, args.size, args.out, pieces):
        records += run_job(job, args.out, args.timeout)
        print(table(records[-1:]).splitlines()[-1], flush=True)
    save(records, args.out / "results.json")
    text = table(records)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all(r.ok for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
