"""What one rule of the audit reports: its name (the rule), whether the logs keep it, and a detail that names the
first samples, steps or versions that break it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SHOWN = 3  # offenders named in a failing check's detail


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    skipped: bool = False  # the rule could not be applied to this run (the detail says why); counts as passing

    @property
    def result(self) -> str:
        return "SKIP" if self.skipped else "PASS" if self.ok else "FAIL"


def examples(offenders: Sequence[str], label: str = "e.g.") -> str:
    """`; e.g. a, b, c (+4 more)` naming the first offenders, or nothing when there are none."""
    if not offenders:
        return ""
    more = f" (+{len(offenders) - SHOWN} more)" if len(offenders) > SHOWN else ""
    return f"; {label} {', '.join(str(o) for o in offenders[:SHOWN])}{more}"
