"""EngineBusy: how long one engine had work, as the union of its requests' intervals minus its pauses.

verl's rollouter/idle_ratio counts only the window in which the rollouter waits for a sync (its issue #6693).
Here every way an engine can sit idle counts, because busy time is measured where it happens: the engine is busy
while at least one request is in it and it is not paused for a weight sync. Concurrent requests overlap, so
counting open requests (busy while > 0) is exactly the union of their intervals; a pause cuts that union.
Idle therefore includes waiting for gate permits, draining before a sync, the sync itself, and the hand-off
between Ray Data calls.

It is not thread-safe: the Generate stage calls it only from its engine's event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class EngineBusy:
    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self.open_requests = 0
        self.paused = False
        self._busy_since: float | None = None
        self._busy_s = 0.0
        self._window_start = now()

    def request_started(self) -> None:
        self.open_requests += 1
        self._update()

    def request_finished(self) -> None:
        if self.open_requests == 0:
            raise RuntimeError("request_finished without a matching request_started")
        self.open_requests -= 1
        self._update()

    def pause(self) -> None:
        self.paused = True
        self._update()

    def resume(self) -> None:
        self.paused = False
        self._update()

    def report(self) -> dict[str, float]:
        """Busy and wall seconds since the previous report; the next window starts now."""
        now = self._now()
        busy = self._busy_s + (now - self._busy_since if self._busy_since is not None else 0.0)
        window = now - self._window_start
        self._busy_s, self._window_start = 0.0, now
        if self._busy_since is not None:
            self._busy_since = now
        return {"busy_s": busy, "window_s": window}

    def _update(self) -> None:
        busy = self.open_requests > 0 and not self.paused
        if busy and self._busy_since is None:
            self._busy_since = self._now()
        elif not busy and self._busy_since is not None:
            self._busy_s += self._now() - self._busy_since
            self._busy_since = None


def idle_ratio(reports: list[dict[str, float]]) -> float:
    """Share of engine-seconds without work over all replicas' windows (each engine weighs by its window)."""
    window = sum(r["window_s"] for r in reports)
    return 1.0 - sum(r["busy_s"] for r in reports) / window if window > 0 else 0.0
