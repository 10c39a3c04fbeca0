"""A million-row prompt file: what starting a run costs, and that it does not depend on total_rollout_steps.

Writes a 1,000,000-row flat prompt file (short arithmetic questions) and, in a fresh process per total
(rollout.total_rollout_steps = 1e6 and 1e8), times the source's start-up part as `pipeline/prepare.py` runs it: read
the file, the checks up front (columns, agent names, Arrow's scan of every row, the first rows validated and
tokenized), the lazy admission order; and the driver's peak RSS growth over it. Then it pulls the first blocks of
the 1e8 source through the real Ray Data input (pipeline/stream.py: the read task validates and tokenizes a chunk at a
time), checks they are the layout's first blocks, and reports the object-store bytes Ray Data read ahead while the
consumer stood still.

    python -m bench.prompts_1m            # about a minute on 2 cores
    python -m bench.prompts_1m --before   # also every row and block built up front, at 1e6 (minutes, GBs)
    python -m bench.prompts_1m --smoke    # seconds: 2,000 rows, one process per total; figures void
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = 1_000_000
TOTALS = (10**6, 10**8)
BLOCK_ROWS = 8  # rollout.prompts_per_call
MAX_PROMPT_LENGTH = 64


def write_prompts(path: Path, rows: int, seed: int = 0) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    a, b = np.random.default_rng(seed).integers(0, 1000, size=(2, rows)).tolist()
    pq.write_table(
        pa.table(
            {
                "prompt_text": [f"What is {x} + {y}? Answer with the number." for x, y in zip(a, b, strict=True)],
                "ground_truth": [str(x + y) for x, y in zip(a, b, strict=True)],
                "data_source": ["arith"] * rows,
            }
        ),
        path,
    )


def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def build_source(path: Path, model_dir: Path, total: int):
    from pipeline.tasks.admission import AdmissionOrder, PromptSource
    from pipeline.tasks.source import PromptFile

    prompts = PromptFile(str(path), tokenizer(model_dir), MAX_PROMPT_LENGTH, "single_turn_agent")
    order = AdmissionOrder(prompts.num_rows, total, seed=0)
    return PromptSource(prompts.check_up_front(), order, BLOCK_ROWS)


def measure(path: Path, model_dir: Path, total: int, mode: str) -> dict:
    """In this (fresh) process: seconds and peak-RSS growth of building the source, lazily or everything up front."""
    import pyarrow as pa

    tokenizer(model_dir)  # imports and the tokenizer's load are not the source's cost
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    source = build_source(path, model_dir, total)
    blocks = list(source.blocks()) if mode == "eager" else []  # held while measured, as the run would hold them
    seconds = time.perf_counter() - start
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    return {
        "seconds": seconds,
        "rss_mib": growth_mib,
        "table_mib": source.prompts.table.nbytes / 2**20,
        "arrow_mib": pa.total_allocated_bytes() / 2**20,
        "blocks": len(blocks),
    }


def in_fresh_process(path: Path, model_dir: Path, total: int, mode: str, repeats: int) -> dict:
    """The fastest time of `repeats` fresh processes (the others share 2 cores with whatever else runs) and the range
    of their peak RSS growths (the allocators return memory at their own pace)."""
    args = [sys.executable, "-m", "bench.prompts_1m", "--measure", str(path), str(model_dir), str(total), mode]
    runs = []
    for _ in range(repeats):
        out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    fastest = min(runs, key=lambda r: r["seconds"])
    rss = sorted(r["rss_mib"] for r in runs)
    return {**fastest, "rss": f"{rss[0]:.0f}-{rss[-1]:.0f}" if len(rss) > 1 else f"{rss[0]:.0f}"}


class Admissions:
    """Stands in for the VersionClock, the one call of it the read task makes: how many prompts were admitted."""

    def __init__(self) -> None:
        self.admitted = 0

    def admit(self, n: int) -> None:
        self.admitted += n

    def stats(self) -> dict:
        return {"admitted_total": self.admitted}


def pull(path: Path, model_dir: Path, out: Path, total: int, n_blocks: int = 5, still_s: float = 20.0) -> dict:
    """The first blocks through Ray Data's input, admitted as the gate would; then how far the read got ahead."""
    import ray

    from pipeline.config import load_config
    from pipeline.prepare import start_ray
    from pipeline.stream import configure_data_context
    from pipeline.tasks.prompt_input import prompt_dataset
    from stages.ray_internals import executor_metrics, wait_for_data_threads

    source = build_source(path, model_dir, total)
    expected = [b for _, b in zip(range(n_blocks), source.blocks(), strict=False)]
    start_ray(load_config(None, []), out)
    try:
        configure_data_context(-1)
        clock = ray.remote(Admissions).options(name="admissions", namespace="bench", num_cpus=0).remote()
        start = time.perf_counter()
        ds = prompt_dataset(source, ("admissions", "bench"))
        batches = iter(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0))
        first = [next(batches)]
        first_s = time.perf_counter() - start
        first += [next(batches) for _ in range(n_blocks - 1)]
        ray.get(clock.admit.remote(sum(b.num_rows for b in first)))  # as the gate would
        time.sleep(still_s)
        ops = executor_metrics()
        read, cut = ops["ReadPrompts"], ops["StreamingRepartition"]
        batches.close()
        wait_for_data_threads(timeout_s=30)
    finally:
        ray.shutdown()
    return {
        "first_s": first_s,
        "same": all(a.equals(b) for a, b in zip(first, expected, strict=True)),
        "ids": first[0]["prompt_id"].to_pylist()[:3],
        "read_mib": read.bytes_task_outputs_generated / 2**20,
        "read_rows": read.rows_task_outputs_generated,
        "cut_blocks": cut.num_task_outputs_generated,
        "still_s": still_s,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", action="store_true", help="also build every row and block up front at 1e6")
    parser.add_argument("--measure", nargs=4, metavar=("PATH", "MODEL_DIR", "TOTAL", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="2,000 rows, one process per total: seconds")
    args = parser.parse_args(argv)
    if args.measure:
        path, model_dir, total, mode = args.measure
        result = measure(Path(path), Path(model_dir), int(total), mode)
        print(json.dumps(result))
        return result
    rows, repeats, still_s = (2000, 1, 1.0) if args.smoke else (ROWS, 3, 20.0)
    from pipeline.tasks.embedded import build_tokenizer

    out = Path(tempfile.mkdtemp(prefix="asyncrl-bench-prompts-"))
    path, model_dir = out / "prompts.parquet", out / "tokenizer"
    write_prompts(path, rows)
    build_tokenizer(model_dir, seed=0)
    print(f"bench: {rows:,} rows in {path} ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)
    runs = [("lazy", total) for total in TOTALS] + ([("eager", TOTALS[0])] if args.before else [])
    results = []
    for mode, total in runs:
        results.append((mode, total, in_fresh_process(path, model_dir, total, mode, repeats if mode == "lazy" else 1)))
        print(f"bench: {mode} total={total:.0e}: {results[-1][2]['seconds']:.2f} s", flush=True)
    pulled = pull(path, model_dir, out, TOTALS[-1], still_s=still_s)
    header = (
        "source",
        "total_rollout_steps",
        "start-up s",
        "peak RSS growth MiB",
        "Arrow MiB held",
        "prompt table MiB",
    )
    widths = (18, 20, 11, 20, 15, 17)
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for mode, total, r in results:
        name = "lazy" if mode == "lazy" else "all up front"
        cells = (
            name,
            f"{total:.0e}",
            f"{r['seconds']:.2f}",
            r["rss"],
            f"{r['arrow_mib']:.0f}",
            f"{r['table_mib']:.1f}",
        )
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    print(
        f"Ray Data input at 1e8: first block in {pulled['first_s']:.2f} s; the first 5 blocks "
        f"{'are' if pulled['same'] else 'are NOT'} the layout's ({', '.join(pulled['ids'])}, ...); with those "
        f"admitted and the consumer still for {pulled['still_s']:.0f} s, the read had laid out "
        f"{pulled['read_rows']:,} prompts ({pulled['read_mib']:.1f} MiB), cut into {pulled['cut_blocks']:,} blocks"
    )
    print(
        f"{rows:,} rows, {BLOCK_ROWS} prompts per block, data.max_prompt_length={MAX_PROMPT_LENGTH}, 2 cores; "
        f"start-up = read + checks up front + lazy layout, the fastest of {repeats} fresh processes per total"
    )
    return {"results": results, "pulled": pulled}


if __name__ == "__main__":
    main()
