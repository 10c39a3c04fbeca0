"""`asyncrl`: the command line. Parses first, imports torch, vLLM and Ray only when a command runs."""

from __future__ import annotations

import argparse
import signal
import sys

USAGE = """asyncrl run [CONFIG] [key=value ...]   run a job (default: conf/default.yaml, the embedded CPU task)
asyncrl audit RUN_DIR                   re-check a finished run from its logs
asyncrl plan [CONFIG] [key=value ...] --gpus N [...]
                                        recommend a trainer:rollout split and staleness for a GPU budget"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description="Fully-async RL post-training on Ray Data.", usage=USAGE
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run a job")
    run_p.add_argument("items", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    audit_p = sub.add_parser("audit", help="audit a run directory")
    audit_p.add_argument("run_dir")
    plan_p = sub.add_parser("plan", help="recommend a trainer:rollout split (simulated; see pipeline/sim/planner.py)")
    plan_p.add_argument("items", nargs="*", help="a CONFIG.yaml with a `sim` workload, then key=value overrides")
    plan_p.add_argument("--gpus", type=int, required=True, help="GPU budget")
    plan_p.add_argument("--gpus-per-replica", type=int, default=8, help="GPUs of one engine (the split's step)")
    plan_p.add_argument("--sim-engine-gpus", type=int, default=8, help="GPUs the config's sim.slots stand for")
    plan_p.add_argument("--sim-trainer-gpus", type=int, default=8, help="GPUs sim.train_s_per_token was taken on")
    plan_p.add_argument("--switch-s", type=float, default=None, help="colocated switch time (default: sync time)")
    plan_p.add_argument("--max-staleness", type=float, default=0.5, help="largest staleness_threshold to propose")
    args = parser.parse_args(argv)
    if args.command == "audit":
        return _audit(args.run_dir)
    if args.command == "plan":
        return _plan(args)
    return _run(args.items)


def _run(items: list[str]) -> int:
    from pipeline.checkpoint import ResumeError
    from pipeline.config import ConfigError, load_config
    from pipeline.tasks.source import PromptDataError

    path = items[0] if items and "=" not in items[0] else None
    overrides = items[1:] if path else items
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    for notice in cfg.notices:  # verl keys accepted without effect, once each
        print(f"asyncrl: note: {notice}", file=sys.stderr)
    from pipeline.finish import RunFailed, RunInterrupted
    from pipeline.run import run

    # Ctrl-C must reach the run even when this process was started with SIGINT ignored (a child inherits an ignored
    # signal, and Python then installs no handler of its own): the run turns it into a clean stop.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        summary = run(cfg)
    except RunInterrupted as err:
        print(f"asyncrl: {err}", file=sys.stderr)
        return 130  # the shell's code for a run ended by SIGINT
    except KeyboardInterrupt:
        print("asyncrl: interrupted while starting, before the first step; nothing was trained", file=sys.stderr)
        return 130
    except ConfigError as err:  # found at start-up: an unreachable tracking URI, lengths beyond the model's
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    except (PromptDataError, ResumeError, FileNotFoundError) as err:
        # A row the stream found bad arrives wrapped in Ray's task error, whose str() is the worker's traceback.
        print(f"asyncrl: input error: {getattr(err, 'cause', None) or err}", file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"asyncrl: run failed: {err}", file=sys.stderr)
        return 1
    return 0 if summary["audit_ok"] else 1


def _plan(args: argparse.Namespace) -> int:
    from pipeline.config import ConfigError, load_config
    from pipeline.sim.planner import Hardware, replica_gpus, report

    path = args.items[0] if args.items and "=" not in args.items[0] else None
    try:
        cfg = load_config(path, args.items[1:] if path else args.items)
        hw = Hardware(
            args.gpus,
            args.gpus_per_replica,
            args.sim_engine_gpus,
            args.sim_trainer_gpus,
            args.switch_s,
            trainer_replica_gpus=replica_gpus(cfg),
        )
        print(report(cfg, hw, args.max_staleness))
    except (ConfigError, ValueError) as err:
        print(f"asyncrl plan: {err}", file=sys.stderr)
        return 2
    return 0


def _audit(run_dir: str) -> int:
    from pipeline.observe.audit import RunDirError, audit

    try:
        report = audit(run_dir)
    except RunDirError as err:
        print(f"asyncrl: cannot audit: {err}", file=sys.stderr)
        return 2
    print(report.table())
    print(f"audit: {'PASS' if report.ok else 'FAIL'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
