"""Route capture's cost: generated tokens per second of one vLLM engine serving the embedded MoE model, with the
router hook that captures routes for routing replay (and the stage fetching every request's rows) and without it.

One engine, the same 64 prompts x 64 tokens each round, rounds alternating between capture on and off, so the
machine's background load falls on both alike; the median round of each is reported. The engine runs without prefix
caching in both (the hook needs it off); what prefix caching would save besides depends on how much prompt the
requests share (a GRPO group shares its prompt).

    python -m bench.routes          # about 2 minutes on 2 cores
    python -m bench.routes --smoke  # the engine's start-up, then one round each way of 4 prompts x 8 tokens

The suite runs `rounds` and `report` as the smoke does on the engine of tests/pipeline/test_moe_routes.py (an engine
start saved), not this command.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import tempfile
import time
from pathlib import Path

PROMPTS, TOKENS, ROUNDS = 64, 128, 8


def rounds(replica, prompts: list[list[int]], tokens: int = TOKENS, count: int = ROUNDS) -> dict[bool, list[float]]:
    """Tokens per second of each round, by whether capture was on; rounds alternate, the first of each uncounted."""
    engine = replica.engine
    capture = engine.route_capture

    async def one_round(tag: str) -> float:
        start = time.perf_counter()
        segs = await asyncio.gather(*(replica.segment(p, tokens, f"{tag}-{i}") for i, p in enumerate(prompts)))
        return sum(len(s.tokens) for s in segs) / (time.perf_counter() - start)

    def measure(on: bool, tag: str) -> float:
        engine.route_capture = capture if on else None
        replica.run(engine.llm.collective_rpc("start_route_capture" if on else "stop_route_capture"))
        return replica.run(one_round(tag))

    measure(True, "warm-on")
    measure(False, "warm-off")
    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(count):
        for on in (r % 2 == 0, r % 2 == 1):
            rates[on].append(measure(on, f"{r}-{on}"))
    return rates


def main(argv: list[str] | None = None) -> dict[bool, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one round each way, 4 prompts x 8 tokens; figures void")
    args = parser.parse_args(argv)
    prompts, tokens, count = (4, 8, 2) if args.smoke else (PROMPTS, TOKENS, ROUNDS)
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from pipeline.tasks.embedded import build_embedded
    from stages.generate import VLLMGenerate

    task = build_embedded(Path(tempfile.mkdtemp(prefix="asyncrl-bench-routes-")), 200, seed=0, arch="moe")
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    gen = VLLMGenerate(
        str(task.model_dir),
        "",
        "",
        n=1,
        max_tokens=tokens,
        max_model_len=192,
        validation_only=True,
        ignore_eos=True,
        enable_rollout_routing_replay=True,
        routed_experts_capture="hook",
    )
    rows = pq.read_table(task.data_file).to_pylist()[:prompts]
    rates = rounds(
        gen.replica, [tokenizer(r["prompt_text"], add_special_tokens=False)["input_ids"] for r in rows], tokens, count
    )
    del gen  # the engine shuts down now, not while the interpreter exits
    gc.collect()
    report(rates, prompts, tokens)
    return rates


def report(rates: dict[bool, list[float]], prompts: int, tokens: int) -> None:
    """The table: the median round each way, every round, and what capture costs."""
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"{'route capture':<16} {'tokens/s (median)':>18}  rounds")
    print(f"{'off':<16} {off:>18.0f}  {', '.join(f'{x:.0f}' for x in rates[False])}")
    print(f"{'on (hook)':<16} {on:>18.0f}  {', '.join(f'{x:.0f}' for x in rates[True])}")
    print(f"capture costs {100 * (1 - on / off):.1f}% of the throughput ({prompts} prompts x {tokens} tokens)")


if __name__ == "__main__":
    main()
