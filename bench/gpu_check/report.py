"""The GPU check's records, their checks and the table they make.

Every piece writes records: one per thing it ran (a backend, a device, a dtype), each with what it measured, the
checks it made (a value against a limit) and its cost (seconds, peak GPU memory). The driver (__main__.py) gathers
them into one markdown table and fails if any check failed, so a run's table and its exit status say the same.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Check:
    """`value` must be at most `limit` (a difference, a mismatch) or, with `at_least`, at least it."""

    what: str
    value: float
    limit: float
    at_least: bool = False

    @property
    def ok(self) -> bool:
        if not math.isfinite(self.value):
            return False
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    def text(self) -> str:
        sign = ">=" if self.at_least else "<="
        return f"{self.what} {self.value:.3g} {sign} {self.limit:.3g}"


@dataclass
class Record:
    piece: str  # what ran: "torch single fp32", "megatron fp32", "ipc push"
    device: str  # the device's name (the GPU's model, or "cpu")
    values: dict[str, float] = field(default_factory=dict)  # what it measured, for the table
    checks: list[Check] = field(default_factory=list)
    time_s: float = 0.0  # the measured work (a step, a push), not the set-up
    peak_gpu_mib: float = 0.0  # torch.cuda.max_memory_allocated over the piece's work, 0 on CPU

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, what: str, value: float, limit: float, at_least: bool = False) -> None:
        self.checks.append(Check(what, float(value), float(limit), at_least))


def relative(value: float, reference: float) -> float:
    """|value - reference| / max(|reference|, 1e-6): a difference that means the same at any scale."""
    return abs(value - reference) / max(abs(reference), 1e-6)


def max_abs_diff(rows: list[list[float]], reference: list[list[float]]) -> float:
    """The largest difference between two ragged tables of the same shape (per-token logprobs)."""
    return max((abs(a - b) for r, q in zip(rows, reference, strict=True) for a, b in zip(r, q, strict=True)), default=0)


def save(records: list[Record], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in records], indent=1))


def load(path: Path) -> list[Record]:
    out = []
    for raw in json.loads(path.read_text()):
        checks = [Check(**c) for c in raw.pop("checks")]
        out.append(Record(**raw, checks=checks))
    return out


def table(records: list[Record]) -> str:
    """One markdown row per record: what ran, where, what it measured, its checks, its cost."""
    lines = [
        "| piece | device | measured | checks | time s | peak GPU MiB | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        measured = ", ".join(f"{k} {v:.4g}" for k, v in r.values.items())
        checks = "; ".join(c.text() for c in r.checks)
        lines.append(
            f"| {r.piece} | {r.device} | {measured} | {checks} | {r.time_s:.2f} | {r.peak_gpu_mib:.0f} | "
            f"{'yes' if r.ok else 'NO'} |"
        )
    return "\n".join(lines)


class Meter:
    """Times a piece's work and reads its peak GPU memory: CUDA work is synchronised before each reading, and the
    peak is reset when the meter starts."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self.time_s = 0.0
        self.peak_gpu_mib = 0.0

    def __enter__(self) -> Meter:
        import time

        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        import time

        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20
        self.time_s = time.perf_counter() - self._start


def device_name(device) -> str:
    """The GPU's model for a CUDA device, else "cpu"."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
