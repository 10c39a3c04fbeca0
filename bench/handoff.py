"""Bytes that cross the driver per step: the stream consumed whole (Ray Data's iter_batches, as before) against the
hand-off (stages/handoff.py: light columns to the driver, per-token columns from the object store to the trainer).

One synthetic step shaped like verl's 7B table's at a smaller scale (`--responses` of `--mean-tokens` tokens on average,
with logprobs, token versions, mask, advantages and text), in blocks of one group, on a local Ray. Both ways run in
this one process, side by side; the figure printed per way is the Arrow bytes the driver received, and the ratio.

    python -m bench.handoff [--responses 256] [--mean-tokens 8192]
    python -m bench.handoff --smoke        # seconds: 32 responses of 64 tokens; figures void
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
import ray

from schemas import SAMPLE_SCHEMA
from stages.handoff import ByReference, SplitTokens, TokenTables

GROUP = 16  # responses per prompt (verl's 7B run's n)


def _block(pid: int, mean_tokens: int, rng) -> pa.Table:
    lengths = np.clip(rng.normal(mean_tokens, mean_tokens / 3, GROUP), 16, 4 * mean_tokens).astype(int)
    cols = {name: [None] * GROUP for name in SAMPLE_SCHEMA.names}
    cols |= {
        "prompt_id": [f"p{pid}"] * GROUP,
        "sample_id": [f"p{pid}/{i}" for i in range(GROUP)],
        "prompt_ids": [rng.integers(0, 150_000, 256).tolist()] * GROUP,
        "response_ids": [rng.integers(0, 150_000, n).tolist() for n in lengths],
        "response_text": ["x" * int(4 * n) for n in lengths],  # about 4 characters per token
        "response_logprobs": [(-rng.random(n)).tolist() for n in lengths],
        "token_param_version": [[3] * int(n) for n in lengths],
        "response_mask": [[1] * int(n) for n in lengths],
        "token_advantages": [[0.5] * int(n) for n in lengths],
        "param_version": [3] * GROUP,
        "num_tokens": lengths.tolist(),
        "reward": [1.0] * GROUP,
    }
    return pa.table(cols, schema=SAMPLE_SCHEMA)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--mean-tokens", type=int, default=8192)
    parser.add_argument("--smoke", action="store_true", help="32 responses of 64 tokens: seconds; figures void")
    args = parser.parse_args(argv)
    if args.smoke:
        args.responses, args.mean_tokens = 32, 64
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rng = np.random.default_rng(0)
    blocks = [_block(p, args.mean_tokens, rng) for p in range(args.responses // GROUP)]
    tokens = sum(sum(b["num_tokens"].to_pylist()) for b in blocks)
    dataset = ray.data.from_arrow(blocks).materialize()  # in the object store, as the stream's blocks are

    start = time.monotonic()
    whole = sum(t.nbytes for t in dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=0))
    whole_s = time.monotonic() - start
    start = time.monotonic()  # the split itself counts here: the stream's last stage does it
    tables = TokenTables.start()
    split = dataset.map_batches(
        SplitTokens,
        fn_constructor_kwargs={"tables": tables},
        batch_size=None,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=1),
    )
    delivered = list(ByReference(split, tables))
    light, heavy = sum(d.light.nbytes for d in delivered), sum(d.heavy_bytes for d in delivered)
    light_s = time.monotonic() - start
    ray.shutdown()
    print(f"one step: {args.responses} responses, {tokens:,} response tokens, {whole / 2**20:.1f} MiB of samples")
    print(f"{'way':<34} {'driver MiB':>11} {'driver s':>9}")
    print(f"{'whole blocks (iter_batches)':<34} {whole / 2**20:>11.2f} {whole_s:>9.2f}")
    print(f"{'hand-off (light columns only)':<34} {light / 2**20:>11.3f} {light_s:>9.2f}")
    print(f"driver bytes, hand-off / whole: {light / whole:.4f}; left in the object store: {heavy / 2**20:.1f} MiB")
    return {"whole": whole, "light": light, "heavy": heavy}


if __name__ == "__main__":
    main()
