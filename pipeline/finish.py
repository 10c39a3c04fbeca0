"""The end of a run: the gate's ledger to disk, the stream stopped, the logs audited, the summary printed and
handed to the monitor."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.observe.audit import audit
from pipeline.observe.summary import format_summary, summarize
from pipeline.stream import wait_for_executors
from schemas import ADMITTED_SCHEMA


def finish_run(ctx, clock, sink) -> dict[str, Any]:
    """Write the gate's ledger, stop the stream, audit the logs, print the summary and hand the audit and summary
    to the monitor, which then ends the run as finished. Ray is stopped last, by the caller: the shorter the time
    between ray.shutdown() and the end of the process, the less a stray library thread can run into it."""
    ray.get(clock.close.remote())
    admissions = ray.get(clock.admissions.remote())
    pq.write_table(
        pa.table(
            {
                "prompt_id": [a[0] for a in admissions],
                "admitted_version": [a[1] for a in admissions],
                "admitted_time": [a[2] for a in admissions],
            },
            schema=ADMITTED_SCHEMA,
        ),
        ctx.run_dir / "admitted.parquet",
    )
    outstanding = ray.get(clock.stats.remote())["outstanding"]
    sink.close()
    wait_for_executors()  # before ray.shutdown(): see there
    report = audit(ctx.run_dir)
    (ctx.run_dir / "audit.txt").write_text(report.table() + "\n")
    summary = summarize(ctx.run_dir, report)
    summary["prompts_outstanding_in_clock"] = outstanding
    summary["prompts_buffered_unconsumed"] = len(sink.leftover())
    (ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_summary(summary, report), flush=True)
    ctx.monitor.log_artifacts([ctx.run_dir / "summary.json", ctx.run_dir / "audit.txt"])
    ctx.monitor.close(ok=True)
    return summary
