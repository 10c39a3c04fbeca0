"""Monitors: where the driver sends metrics. Stages never log; they emit measurement columns.

`Monitor` is a swap point (JSONL here; MLflow elsewhere). Keys follow verl's names where verl has them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol


class Monitor(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class JsonlMonitor:
    """One JSON object per step in `metrics.jsonl`, flushed as it goes so a crashed run keeps its history."""

    def __init__(self, run_dir: Path) -> None:
        self.file = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class NullMonitor:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        pass


def make_monitor(kind: str, run_dir: Path) -> Monitor:
    return JsonlMonitor(run_dir) if kind == "jsonl" else NullMonitor()
