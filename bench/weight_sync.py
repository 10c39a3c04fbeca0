"""Weight-sync throughput: the trainer's BroadcastSender (gloo) pushing to an engine worker's WeightReceiver in another
process, for models of ~1M to ~100M parameters, next to this machine's memory-copy bandwidth for the same tensors.

Both ends are the pipeline's code (stages/transports/broadcast.py, stages/engines/vllm_worker.py); only vLLM's
`reload_weights` is replaced by a copy into preallocated buffers, so the figure is the transport's. Then a model of
small tensors (the embedded job's: 27 tensors, 1.9 MB), pushed as a run pushes it (small tensors packed into one
broadcast) against one push per tensor (one broadcast each, as before the packing).

    python -m bench.weight_sync            # about a minute on 2 cores
    python -m bench.weight_sync --smoke    # seconds: the 1M model and the small tensors, one push each; figures void
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

SIZES = {"1M": 1_000_000, "10M": 10_000_000, "100M": 100_000_000}
REPEATS = 3


def small_model_shapes(vocab: int = 291, hidden: int = 128, ffn: int = 384, kv: int = 64, layers: int = 2):
    """A Qwen2-style model's tensors (the embedded job's by default), in its checkpoint's order of kinds."""
    layer = [[hidden, ffn], [ffn, hidden], [ffn, hidden], [hidden], [kv], [kv, hidden], [hidden, hidden], [hidden]]
    layer += [[hidden, hidden], [kv], [kv, hidden], [hidden]]
    return [[vocab, hidden], [vocab, hidden], [hidden]] + layer * layers


def layer_shapes(params: int, hidden: int = 512) -> list[list[int]]:
    """Square matrices of `hidden` (a transformer's projections), enough of them for `params`."""
    hidden = min(hidden, int(params**0.5))
    return [[hidden, hidden]] * max(1, params // (hidden * hidden))


class _Runner:
    """Stands in for vLLM's model runner: loads the streamed tensors into buffers it owns."""

    def __init__(self, shapes: list[list[int]]) -> None:
        self.buffers = {f"w{i}": torch.empty(s) for i, s in enumerate(shapes)}

    def reload_weights(self, weights_iterator) -> None:
        for name, tensor in weights_iterator:
            self.buffers[name].copy_(tensor)

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()


def _engine(host: str, port: int, shapes: list[list[int]], rounds: int, one_by_one: bool) -> None:
    from stages.engines.vllm_worker import WeightReceiver, repack_cpu_experts

    torch.set_num_threads(1)
    repack_cpu_experts(torch.nn.Module())  # its vLLM imports (seconds) before the clock starts, not in a push
    receiver = WeightReceiver()
    receiver.model_runner, receiver.rank = _Runner(shapes), 0
    receiver.init_weight_group(host, port, 1, 2, "gloo")
    names, dtypes = [f"w{i}" for i in range(len(shapes))], ["float32"] * len(shapes)
    cut = [slice(i, i + 1) for i in range(len(shapes))] if one_by_one else [slice(None)]
    for _ in range(rounds):
        for part in cut:
            receiver.receive_weights(names[part], shapes[part], dtypes[part])


def measure(shapes: list[list[int]], one_by_one: bool = False, repeats: int = REPEATS) -> tuple[float, float, float]:
    """(bytes, seconds per push, seconds per memory copy of the same tensors); `one_by_one`: a push per tensor."""
    from stages.transports.broadcast import BroadcastSender

    tensors = [torch.randn(s) for s in shapes]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sync = BroadcastSender()
    group = sync.open(2)
    args = (group.host, group.port, shapes, repeats + 1, one_by_one)
    engine = mp.get_context("spawn").Process(target=_engine, args=args)
    engine.start()
    sync.wait_open()
    named = [(f"w{i}", t) for i, t in enumerate(tensors)]
    pushes = [[w] for w in named] if one_by_one else [named]
    for push in pushes:  # warm-up: connections and the receiver's first allocations
        sync.send(push)
    start = time.perf_counter()
    for _ in range(repeats):
        for push in pushes:
            sync.send(push)
    push_s = (time.perf_counter() - start) / repeats
    engine.join(120)
    if engine.exitcode != 0:
        raise RuntimeError(f"the receiving process ended with code {engine.exitcode}")
    copies = [torch.empty_like(t) for t in tensors]
    start = time.perf_counter()
    for _ in range(repeats):
        for dst, src in zip(copies, tensors, strict=True):
            dst.copy_(src)
    return nbytes, push_s, (time.perf_counter() - start) / repeats


def main(argv: list[str] | None = None) -> list[tuple]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the 1M model and the small tensors, one push each")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes, repeats = ({"1M": SIZES["1M"]}, 1) if args.smoke else (SIZES, REPEATS)
    rows = []
    for name, params in sizes.items():
        nbytes, push_s, copy_s = measure(layer_shapes(params), repeats=repeats)
        rows.append((name, nbytes, push_s, copy_s))
        print(f"bench: {name}: {nbytes / push_s / 1e9:.2f} GB/s", flush=True)
    print(f"\n{'model':>6} {'MB':>8} {'push s':>8} {'push GB/s':>10} {'memcpy GB/s':>12} {'push/memcpy':>12}")
    for name, nbytes, push_s, copy_s in rows:
        print(
            f"{name:>6} {nbytes / 1e6:>8.1f} {push_s:>8.4f} {nbytes / push_s / 1e9:>10.2f} "
            f"{nbytes / copy_s / 1e9:>12.2f} {copy_s / push_s:>12.2f}"
        )
    print("gloo over loopback, one engine, float32; memcpy: the same tensors copied in this process, one thread")
    small = small_model_shapes()
    nbytes, packed_s, _ = measure(small, repeats=repeats)
    _, one_s, _ = measure(small, one_by_one=True, repeats=repeats)
    head = f"small tensors ({len(small)}, {nbytes / 1e6:.1f} MB, the embedded model's)"
    print(f"\n{head}: {packed_s * 1e3:.1f} ms per push packed, {one_s * 1e3:.1f} ms one broadcast per tensor")
    print(f"packed is {one_s / packed_s:.1f}x faster")
    return rows


if __name__ == "__main__":
    main()
