"""A real HTTP reward service for tests, on loopback, in a thread of the test process: it scores with a function the
test gives and injects the faults the test asks for, counting every request it receives per sample."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Answer:
    """What the service does with one request: wait `delay_s`, then answer `status` with `body` (JSON text)."""

    body: str = "0.0"
    status: int = 200
    delay_s: float = 0.0


@dataclass
class RewardServer:
    """`behave(payload, nth)` decides the answer to the nth request (1-based) for the payload's sample_id."""

    behave: Callable[[dict, int], Answer]
    requests: Counter = field(default_factory=Counter)  # sample_id -> requests received
    answered: Counter = field(default_factory=Counter)  # status -> answers sent (a cut request's answer included)
    in_flight: int = 0
    max_in_flight: int = 0  # the most requests the service held at once
    url: str = ""

    def __enter__(self) -> RewardServer:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the test reward server did not start")
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/score", self._score)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/score"
        started.set()
        self._loop.run_forever()

    async def _score(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.requests[payload["sample_id"]] += 1
        answer = self.behave(payload, self.requests[payload["sample_id"]])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if answer.delay_s:
                await asyncio.sleep(answer.delay_s)
        finally:
            self.in_flight -= 1
        self.answered[answer.status] += 1
        return web.Response(text=answer.body, status=answer.status, content_type="application/json")
