"""RemoteReward: score each response with an HTTP reward service, asynchronously: JSON in, a score out.

Input columns:  sample_id, prompt_text, response_text, ground_truth, data_source (reward_sources when present)
Output columns: input columns + reward_sources with a 'remote' record for every sample (stages/reward_sources.py)

One POST per response to `url`, with the arguments verl gives a reward function:
    {"sample_id": ..., "data_source": ..., "prompt": ..., "solution_str": ..., "ground_truth": ...}
The service answers a JSON number, or an object with a numeric "score" (other keys are ignored). A block's requests
run concurrently on one event loop, at most `max_concurrent` at a time (verl's rate-limited manager's cap, here per
stage actor). A request is cut after `timeout_s`; a timeout, a connection error, HTTP 429 or 5xx is tried again up
to `max_retries` more times, after `backoff_s` doubling each time (at most 30 s), without holding a concurrency slot
while it waits. A 4xx, or an answer that is not a finite score, is not retried: asking again would get the same.
What still fails is that sample's error (its record's `error`), never the block's; the record counts the attempts,
and its latency_s is the sample's whole time, waits included.

`check_reachable` is what the driver calls at start: a service that cannot be reached is one error then, not a run
whose every sample fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import numbers
import time
from typing import Any

import aiohttp
import pyarrow as pa

from schemas import require_columns
from stages.reward_sources import record, records_of, with_records

_NEEDS = ["sample_id", "prompt_text", "response_text", "ground_truth", "data_source"]
MAX_BACKOFF_S = 30.0
RETRIED_STATUS = (429,)  # and every 5xx


class RemoteReward:
    def __init__(
        self,
        url: str,
        max_concurrent: int = 8,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        if max_concurrent < 1 or timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError(
                "RemoteReward needs max_concurrent >= 1, timeout_s > 0, max_retries >= 0 and backoff_s >= 0, got "
                f"{max_concurrent}, {timeout_s}, {max_retries}, {backoff_s}"
            )
        self.url, self.max_concurrent, self.timeout_s = url, max_concurrent, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, _NEEDS, "RemoteReward")
        rows = batch.select(_NEEDS).to_pylist()
        scored = _run(self._score_all(rows)) if rows else []
        records = records_of(batch)
        for mine, rec in zip(records, scored, strict=True):
            mine["remote"] = rec
        return with_records(batch, records)

    async def _score_all(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        slots = asyncio.Semaphore(self.max_concurrent)
        # No connection cap of aiohttp's own: the semaphore is the cap. No proxy from the environment (trust_env):
        # the service is called where the URL says.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
            return await asyncio.gather(*(self._score(session, slots, row) for row in rows))

    async def _score(self, session: aiohttp.ClientSession, slots: asyncio.Semaphore, row: dict) -> dict[str, Any]:
        payload = {
            "sample_id": row["sample_id"],
            "data_source": row["data_source"],
            "prompt": row["prompt_text"],
            "solution_str": row["response_text"],
            "ground_truth": row["ground_truth"],
        }
        t0, error = time.monotonic(), None
        for attempt in range(1, self.max_retries + 2):
            if attempt > 1:
                await asyncio.sleep(min(self.backoff_s * 2 ** (attempt - 2), MAX_BACKOFF_S))
            async with slots:
                score, error, again = await self._post(session, payload)
            if error is None:
                return record(score, None, time.monotonic() - t0, attempt)
            if not again:
                break
        return record(None, error, time.monotonic() - t0, attempt)

    async def _post(self, session: aiohttp.ClientSession, payload: dict) -> tuple[float | None, str | None, bool]:
        """(score, error, worth retrying) of one request."""
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with session.post(self.url, json=payload, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    again = resp.status >= 500 or resp.status in RETRIED_STATUS
                    return None, f"HTTP {resp.status} from {self.url}: {text[:200]}", again
        except TimeoutError:
            return None, f"no answer from {self.url} within {self.timeout_s}s", True
        except aiohttp.ClientError as err:
            return None, f"{type(err).__name__} calling {self.url}: {err}"[:500], True
        return *parse_score(text), False


def parse_score(text: str) -> tuple[float | None, str | None]:
    """(score, None) from a service's answer: a JSON number or {"score": number}; else (None, why not)."""
    try:
        body = json.loads(text)
    except ValueError:
        return None, f"the service answered {text[:200]!r}, not JSON"
    value = body.get("score") if isinstance(body, dict) else body
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None, f'the service answered {text[:200]!r}, not a finite number or {{"score": number}}'
    return float(value), None


def _run(coroutine: Any) -> Any:
    """Run a coroutine to its end from synchronous code: here, or on a thread of its own when this thread already
    runs an event loop (asyncio.run refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def check_reachable(url: str, timeout_s: float = 10.0) -> str | None:
    """None if an HTTP server answers at `url` (a GET; any status but 404 will do, a scoring endpoint may well refuse
    a GET), else one message naming the URL, what happened and the key to fix."""

    async def probe() -> str | None:
        try:
            async with aiohttp.ClientSession(trust_env=False) as session:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                    if resp.status == 404:
                        return f"reward.remote.url {url}: the server answers 404 Not Found there; check the path"
                    return None
        except TimeoutError:
            return f"reward.remote.url {url}: no answer within {timeout_s}s. Start the service, or fix the URL"
        except aiohttp.ClientError as err:
            return f"reward.remote.url {url} cannot be reached ({err}). Start the service, or fix the URL"

    return _run(probe())
