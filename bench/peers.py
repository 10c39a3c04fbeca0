"""asyncrl against the library a user would otherwise pick: TRL's GRPOTrainer, on the same work, on the same cores.

Two workloads (bench/peers_workloads.py): (a) `embedded`, the embedded default job exactly; (b) `long`, a ~19M-parameter
model writing 256-token answers, where generation is most of the work (TRL generates with transformers' `generate`,
asyncrl with vLLM). The systems take turns, one run at a time on the whole machine, in the order A B B A ... so that
neither always runs first. TRL is installed by this script into a virtualenv of its own (TRL_PINS, with this
project's torch and transformers versions, so the model code is the same), never into the project's.

Per system and workload, the median over its runs of: start-up (launch to the end of the first step), wall time from
launch to a moving-average reward (WINDOW steps) of 0.6 and of 0.8, the same counted from the end of the first step
(learning alone), steps/s and trained (response) tokens/s after the first SKIP steps, peak memory (PSS of the whole
process tree), and the reward over the first and last 10 % of steps. Also the reward-vs-wall-time curves as a PNG.

    python -m bench.peers                          # both workloads, 2 runs per system each (tens of minutes)
    python -m bench.peers --workloads embedded --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.peers_runs import Run, run_asyncrl, run_trl
from bench.peers_workloads import LONG_STEPS, WORKLOADS, prepare

TRL_PINS = ["trl==1.16.0", "transformers==5.19.0", "accelerate==1.15.0", "datasets==5.2.0", "torch==2.13.0"]
VENV = Path("~/.cache/asyncrl/peers-venv").expanduser()
TARGETS = (0.6, 0.8)
WINDOW = 10  # steps in the moving average of the reward
SKIP = 10  # first steps left out of the rates (start-up, the engine's first calls)


def ensure_trl(venv: Path) -> Path:
    """The python of a virtualenv with TRL_PINS (made and installed on first use: about 2 minutes)."""
    python, marker = venv / "bin" / "python", venv / "asyncrl-pins.txt"
    if marker.exists() and marker.read_text() == "\n".join(TRL_PINS):
        return python
    print(f"bench: installing {' '.join(TRL_PINS)} into {venv}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    # torch==2.13.0 exactly: pip's find-links holds its CPU wheel (a range would pull a CUDA build).
    subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PINS], check=True)
    # A torchvision pulled in by anything would be a CUDA build that breaks transformers' imports.
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio"], check=True)
    marker.write_text("\n".join(TRL_PINS))
    return python


def moving_average(values: list[float], window: int = WINDOW) -> list[float]:
    """The mean of the last `window` values at each position (of fewer at the start)."""
    out = []
    for i in range(len(values)):
        span = values[max(0, i + 1 - window) : i + 1]
        out.append(sum(span) / len(span))
    return out


def time_to(run: Run, target: float) -> tuple[int, float] | None:
    """(step, s since launch) of the first step whose WINDOW-step moving reward reaches target (full windows only)."""
    smooth = moving_average([r for _, _, r, _ in run.steps])
    for i, (step, at, _, _) in enumerate(run.steps):
        if i + 1 >= WINDOW and smooth[i] >= target:
            return step, at
    return None


def rates(run: Run, skip: int = SKIP) -> tuple[float, float]:
    """(steps/s, trained tokens/s) from the end of step `skip` to the end of the last step."""
    if len(run.steps) <= skip + 1:
        return float("nan"), float("nan")
    window = run.steps[skip:]
    span = window[-1][1] - run.steps[skip - 1][1] if skip else window[-1][1] - window[0][1]
    return len(window) / span, sum(t for *_, t in window) / span


def summary(run: Run) -> dict:
    """One run's row: start-up, times to each target (from launch and from the first step), rates, memory, rewards."""
    rewards = [r for _, _, r, _ in run.steps]
    tenth = max(1, len(rewards) // 10)
    row = {
        "startup_s": run.steps[0][1] if run.steps else float("nan"),
        "steps": len(run.steps),
        "peak_gib": run.peak_bytes / 2**30,
        "first": statistics.fmean(rewards[:tenth]) if rewards else float("nan"),
        "last": statistics.fmean(rewards[-tenth:]) if rewards else float("nan"),
    }
    row["steps_per_s"], row["tokens_per_s"] = rates(run)
    for target in TARGETS:
        hit = time_to(run, target)
        row[f"to{target}"] = hit[1] if hit else float("nan")
        row[f"train_to{target}"] = hit[1] - row["startup_s"] if hit else float("nan")
        row[f"step{target}"] = hit[0] if hit else None
    return row


def median_row(rows: list[dict]) -> dict:
    """Each numeric key's median over the runs (nan when a run has none: a target a run missed counts as missed)."""
    keys = [k for k in rows[0] if not k.startswith("step")] + [k for k in rows[0] if k.startswith("step")]
    out = {}
    for k in keys:
        xs = [r[k] for r in rows]
        if any(x is None or x != x for x in xs):
            out[k] = None if k.startswith("step") else float("nan")
        else:
            out[k] = statistics.median(xs)
    return out


def table(workload: str, by_system: dict[str, list[Run]]) -> str:
    """The printed table of one workload: one line per system (medians), then TRL's time over asyncrl's."""
    head = (
        f"{'system':<14} {'runs':>4} {'start-up s':>10} {'to 0.6 s':>9} {'to 0.8 s':>9} {'0.6 train s':>11} "
        f"{'0.8 train s':>11} {'steps/s':>7} {'tokens/s':>8} {'peak GiB':>8} {'reward first -> last 10%':>24} "
        f"{'load':>5}"
    )
    lines = [
        f"workload {workload} (medians over runs; times from launch, 'train' from the end of step 1; load: the "
        "machine's 1-minute load average, the higher of launch and end: 2 or less is this machine alone)",
        head,
    ]
    med = {}
    for system, runs in by_system.items():
        if not runs:
            continue
        m = med[system] = median_row([summary(r) for r in runs])
        lines.append(
            f"{system:<14} {len(runs):>4} {m['startup_s']:>10.1f} {m['to0.6']:>9.1f} {m['to0.8']:>9.1f} "
            f"{m['train_to0.6']:>11.1f} {m['train_to0.8']:>11.1f} {m['steps_per_s']:>7.2f} {m['tokens_per_s']:>8.0f} "
            f"{m['peak_gib']:>8.2f} {m['first']:>15.2f} -> {m['last']:.2f} "
            f"{statistics.median(max(r.load) for r in runs):>5.1f}"
        )
    t = med.get("TRL")
    for system, a in med.items():
        if t is None or system == "TRL":
            continue
        ratios = [f"{key} {t[key] / a[key]:.2f}" for key in ("to0.6", "to0.8", "train_to0.6", "train_to0.8")]
        lines.append(f"TRL's time / {system}'s (> 1: {system} is faster): " + ", ".join(ratios))
        lines.append(f"  steps/s {system} / TRL: {a['steps_per_s'] / t['steps_per_s']:.2f}")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, list[Run]]], path: Path) -> None:
    """Reward (moving average) against wall time from launch, one panel per workload, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.2), squeeze=False)
    for ax, (workload, by_system) in zip(axes[0], results.items(), strict=True):
        variants = (s for s in by_system if s not in ("asyncrl", "TRL"))  # each its own colour, after those two's
        colours = {"asyncrl": "tab:blue", "TRL": "tab:orange"} | {s: f"C{i}" for i, s in enumerate(variants, 2)}
        for system, runs in by_system.items():
            for i, run in enumerate(runs):
                xs = [at for _, at, _, _ in run.steps]
                ax.plot(xs, moving_average([r for *_, r, _ in run.steps]), color=colours[system], alpha=0.8,
                        label=system if i == 0 else None)  # fmt: skip
        for target in TARGETS:
            ax.axhline(target, color="grey", linewidth=0.6, linestyle=":")
        ax.set(title=f"workload {workload}", xlabel="wall seconds from launch", ylabel=f"reward ({WINDOW}-step mean)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=2, help="runs per system and workload, taking turns")
    parser.add_argument("--out", type=Path, default=Path("runs") / f"peers-{time.strftime('%Y%m%d-%H%M%S')}")
    parser.add_argument("--long-steps", type=int, default=LONG_STEPS, help="steps of workload long")
    parser.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process")
    parser.add_argument(
        "--variant",
        nargs="+",
        action="append",
        default=[],
        metavar=("LABEL", "KEY=VALUE"),
        help="one more asyncrl system: its label, then overrides on top of the workload's (repeatable)",
    )
    args = parser.parse_args()
    variants = {"asyncrl": []} | {f"asyncrl[{v[0]}]": v[1:] for v in args.variant}
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    python = ensure_trl(VENV)
    results: dict[str, dict[str, list[Run]]] = {}
    for workload in args.workloads:
        w = prepare(out / "inputs", workload, args.long_steps)
        systems = [*variants, "TRL"]
        by_system = results[workload] = {system: [] for system in systems}
        for i in range(args.repeats):
            for system in systems if i % 2 == 0 else systems[::-1]:  # A B B A: neither side always goes first
                name = f"{workload}-{system.replace('[', '-').rstrip(']')}-{i}"
                if system == "TRL":
                    run = run_trl(w, out, name, python, args.trl_threads)
                else:
                    run = run_asyncrl(w, out, name, variants[system], system)
                if run.returncode != 0 or not run.steps:  # said, and left out; the other runs go on
                    print(f"bench: {name} failed (exit {run.returncode}); its log: {run.log}", flush=True)
                    continue
                by_system[system].append(run)
                s = summary(run)
                with open(out / "runs.jsonl", "a") as f:
                    f.write(json.dumps({"name": name, "load": run.load, **s}) + "\n")
                load = f"load {run.load[0]:.1f} -> {run.load[1]:.1f}"
                print(f"bench: {name}: start-up {s['startup_s']:.1f} s, to 0.8 {s['to0.8']:.1f} s, "
                      f"{s['steps_per_s']:.2f} steps/s, {load}", flush=True)  # fmt: skip
    plot(results, out / "reward_vs_time.png")
    print()
    for workload, by_system in results.items():
        print(table(workload, by_system) + "\n")
    print(f"curves: {out / 'reward_vs_time.png'}; logs and step records in {out}")


if __name__ == "__main__":
    main()
