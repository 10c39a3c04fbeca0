"""Where a step's time goes, from a finished run's own logs: the path from one training step to the next.

A step waits for the prompts it trains on. The ones carried over from the previous version are ready; the ones
admitted after the previous sync ("new") are not, and the last of them to finish sets when the step can start:

    train (step k-1) -> sync -> the gate admits -> the engine starts it -> generates -> the driver has it -> train (k)

Each part is read from the run's logs: the sample log (admitted_time, generated_time, gen_latency_s), the
consumption log (consumed_time, written right after a step's training) and metrics.jsonl (timing/train_s). Printed
as the 10th/50th/90th percentile over the steps (the first `--skip` left out: start-up) and each part's share of the
median step. Steps that train on no new prompt are counted apart.

    python -m bench.timeline RUN_DIR          # a run made with trainer.monitor=jsonl (or a list holding it)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pyarrow.dataset as pads

PARTS = (
    ("sync", "train end -> first admission of the version"),
    ("admit", "first admission -> the last new prompt's engine start"),
    ("generate", "the last new prompt's generation"),
    ("deliver", "its engine end -> training starts"),
    ("train", "training (timing/train_s)"),
)


def load(run_dir: Path) -> tuple[dict, dict, dict]:
    """Per prompt (admitted version and time, engine start and end), per step (consumed time and version, prompts)
    and per step the metrics row."""
    if not (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir}/metrics.jsonl not found: run with trainer.monitor=jsonl (or [mlflow,jsonl])")
    cols = ["prompt_id", "admitted_version", "admitted_time", "generated_time", "gen_latency_s"]
    prompts: dict[str, dict] = {}
    for r in pads.dataset(run_dir / "samples", format="parquet").to_table(columns=cols).to_pylist():
        p = prompts.setdefault(
            r["prompt_id"], {"v": r["admitted_version"], "adm": r["admitted_time"], "s": [], "e": []}
        )
        p["s"].append(r["generated_time"] - r["gen_latency_s"])
        p["e"].append(r["generated_time"])
    steps: dict[int, dict] = {}
    for r in pads.dataset(run_dir / "consumed", format="parquet").to_table().to_pylist():
        s = steps.setdefault(r["consumed_step"], {"t": r["consumed_time"], "v": r["consumed_version"], "ids": set()})
        s["ids"].add(r["prompt_id"])
    metrics = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        metrics[row["step"]] = row
    return prompts, steps, metrics


def paths(prompts: dict, steps: dict, metrics: dict, skip: int) -> tuple[list[dict], int]:
    """Each step's parts (seconds), and how many steps trained on no new prompt."""
    first_admission: dict[int, float] = {}
    for p in prompts.values():
        first_admission[p["v"]] = min(first_admission.get(p["v"], float("inf")), p["adm"])
    out, none_new = [], 0
    for k in sorted(steps):
        if k <= skip or k - 1 not in steps or k not in metrics:
            continue
        step, before = steps[k], steps[k - 1]
        new = [prompts[i] for i in step["ids"] if i in prompts and prompts[i]["v"] == step["v"]]
        if not new:
            none_new += 1
            continue
        last = max(new, key=lambda p: max(p["e"]))
        train = metrics[k]["timing/train_s"]
        start, end, opened = min(last["s"]), max(last["e"]), first_admission[step["v"]]
        out.append(
            {
                "sync": opened - before["t"],
                "admit": start - opened,
                "generate": end - start,
                "deliver": step["t"] - train - end,
                "train": train,
                "period": step["t"] - before["t"],
            }
        )
    return out, none_new


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--skip", type=int, default=10, help="first steps left out (start-up)")
    args = parser.parse_args(argv)
    rows, none_new = paths(*load(args.run_dir), args.skip)
    if not rows:
        raise SystemExit(f"no step after the first {args.skip} trained on new prompts in {args.run_dir}")
    period = statistics.median(r["period"] for r in rows)
    print(f"{len(rows)} steps (after the first {args.skip}); {none_new} more trained on carried-over prompts only")
    print(f"{'part':<56} {'p10 ms':>7} {'p50 ms':>7} {'p90 ms':>7} {'p50 share':>9}")
    for key, label in (*PARTS, ("period", "step to step")):
        xs = sorted(r[key] for r in rows)
        p10, p50, p90 = (xs[int(q * (len(xs) - 1))] for q in (0.1, 0.5, 0.9))
        print(f"{label:<56} {p10 * 1e3:>7.0f} {p50 * 1e3:>7.0f} {p90 * 1e3:>7.0f} {p50 / period:>9.2f}")
    return rows


if __name__ == "__main__":
    main()
