"""Faults of a run as they happen: every restart of a Generate replica or of the trainer, with its cause, in
`faults.jsonl` and on the console, and the counters each step's metrics carry (`fault/*`). `processes.json` says
which processes are the trainer, the replicas and their engines now (an operator's, or a fault-injection test's,
targets)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class FaultLog:
    def __init__(self, run_dir: Path, trainer_restarts: int = 0, trainer_pid: int = 0) -> None:
        self.path = Path(run_dir) / "faults.jsonl"
        self.seen = 0  # the clock's restart events already written
        self.trainer_restarts, self.trainer_pid = trainer_restarts, trainer_pid
        self.replicas: list[dict[str, Any]] = []

    def update(self, clock_faults: dict[str, Any]) -> dict[str, float]:
        """Write the clock's new replica restarts (VersionClock.faults(self.seen)); returns the counters."""
        if clock_faults.get("replicas") and clock_faults["replicas"] != self.replicas:  # who runs where, now
            self.replicas = clock_faults["replicas"]
            processes = {"trainer": self.trainer_pid, "replicas": self.replicas}
            # Read while the run goes on: replaced whole, never seen half-written.
            staged = self.path.parent / "processes.json.tmp"
            staged.write_text(json.dumps(processes, indent=1) + "\n")
            os.replace(staged, self.path.parent / "processes.json")
        for event in clock_faults["events"]:
            self.write({"component": f"generate replica {event['replica']}", **event})
        self.seen += len(clock_faults["events"])
        counters = {k: float(v) for k, v in clock_faults.items() if k.startswith("fault/")}
        return {**counters, "fault/trainer_restarts": float(self.trainer_restarts)}

    def write(self, event: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
        detail = ""
        if "readmitted_prompts" in event:
            detail = f", {event['readmitted_prompts']} prompts in flight re-admitted"
        if "from_step" in event:
            detail = f"; restarting the run from its checkpoint at step {event['from_step']}"
        print(f"asyncrl: {event['component']} restarted: {event['cause']}{detail}", flush=True)
