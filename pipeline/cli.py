"""`asyncrl`: the command line. Parses first, imports torch, vLLM and Ray only when a command runs."""

from __future__ import annotations

import argparse
import sys

USAGE = """asyncrl run [CONFIG] [key=value ...]   run a job (default: conf/default.yaml, the embedded CPU task)
asyncrl audit RUN_DIR                   re-check a finished run from its logs"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="asyncrl", description="Fully-async RL post-training on Ray Data.", usage=USAGE
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run a job")
    run_p.add_argument("items", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    audit_p = sub.add_parser("audit", help="audit a run directory")
    audit_p.add_argument("run_dir")
    args = parser.parse_args(argv)
    if args.command == "audit":
        return _audit(args.run_dir)
    return _run(args.items)


def _run(items: list[str]) -> int:
    from pipeline.checkpoint import ResumeError
    from pipeline.config import ConfigError, load_config
    from pipeline.source import PromptDataError

    path = items[0] if items and "=" not in items[0] else None
    overrides = items[1:] if path else items
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    from pipeline.run import run

    try:
        summary = run(cfg)
    except ConfigError as err:  # found at start-up: an unreachable tracking URI, lengths beyond the model's
        print(f"asyncrl: config error: {err}", file=sys.stderr)
        return 2
    except (PromptDataError, ResumeError, FileNotFoundError) as err:
        print(f"asyncrl: input error: {err}", file=sys.stderr)
        return 2
    return 0 if summary["audit_ok"] else 1


def _audit(run_dir: str) -> int:
    from pipeline.audit import audit

    report = audit(run_dir)
    print(report.table())
    print(f"audit: {'PASS' if report.ok else 'FAIL'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
