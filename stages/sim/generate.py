"""SimGenerate: the Generate stage with a simulated engine that spends time instead of compute.

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source, agent_name, admitted_version,
                admitted_time
Output columns: the same as stages.generate.VLLMGenerate (the two are swapped in conf/ with `stages.generate`)

The engine model is stages.sim.workload.Workload: `slots` sequences at once, a prefill, then a fixed time per token.
Everything a real engine does to the pipeline is here: it registers with the VersionClock, answers the weight
syncs it relays, and at a sync behaves as `pause_mode` says. `wait`: requests in flight finish with the old
weights, new ones queue. `abort`: every sequence stops where it is, keeps its tokens and resumes after the sync
with the new weights, paying its prefill again (KV recomputed). `keep`: the same without the second prefill.
Tokens are labelled with the version that was loaded while they were decoded, exactly as the real engine does.
Token ids are 0 and logprobs 0.0: only lengths, times and versions mean anything here.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns
from schemas.sample import GATE_COLUMNS, GENERATE_COLUMNS, PROMPT_COLUMNS
from stages.control import Ack, ClockLink, Done, Loaded, Posted, PullWeights, PushWeights, Validate, Validated
from stages.engine_busy import EngineBusy
from stages.sim.workload import Workload, split

_IN_COLUMNS = [c.name for c in PROMPT_COLUMNS + GATE_COLUMNS]
_OUT_SCHEMA = pa.schema([SAMPLE_SCHEMA.field(c) for c in _IN_COLUMNS + [c.name for c in GENERATE_COLUMNS]])


class SimGenerate:
    def __init__(
        self,
        clock_name: str,
        namespace: str,
        n: int,
        max_tokens: int,
        sim: dict[str, Any],
        pause_mode: str = "wait",
        initial_version: int = 0,
    ) -> None:
        if pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause_mode must be 'wait', 'abort' or 'keep', not {pause_mode!r}")
        self.clock = ClockLink(clock_name, namespace)
        actor_id = self.clock.actor_id
        self.replica = self.clock.reserve_replica(actor_id)
        self.n, self.max_tokens, self.pause_mode = n, max_tokens, pause_mode
        self.work = Workload(**sim)
        self.scale = self.work.time_scale
        self.version = initial_version
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="sim-engine-loop", daemon=True).start()
        self._run(self._setup())
        reg = self.clock.register_replica(actor_id, os.getpid(), self.clock.node_id, [])
        self.version = max(self.version, reg.version)  # a restarted replica starts at the newest version
        self.control = asyncio.run_coroutine_threadsafe(self._control_loop(reg.seq), self.loop)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _setup(self) -> None:
        # Created on the engine loop: asyncio primitives belong to the loop that uses them.
        self.slots = asyncio.Semaphore(self.work.slots)
        self.state = asyncio.Condition()
        self.paused = False  # a sync is under way: no new request and (abort/keep) no new token
        self.interrupt = asyncio.Event()  # set at the start of an abort/keep sync: decoders stop where they are
        self.active = 0  # trajectories started and not finished (wait mode drains these)
        self.decoding = 0  # requests inside a decode segment (abort/keep wait until these stop)
        self.busy = EngineBusy()
        self.holding = 0  # validation shares that hold new requests (parallel_validate_and_rollout=false)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, _IN_COLUMNS, "SimGenerate")
        rows = batch.select(_IN_COLUMNS).to_pylist()
        future = asyncio.run_coroutine_threadsafe(self._generate_rows(rows), self.loop)
        return pa.Table.from_pylist(await asyncio.wrap_future(future), schema=_OUT_SCHEMA)

    async def _generate_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Pull mode: prompts admitted at a version this replica has not loaded yet wait for it (the lag bound).
        need = max(row["admitted_version"] for row in rows)
        async with self.state:
            await self.state.wait_for(lambda: self.version >= need and not self.holding)
        return list(await asyncio.gather(*(self._one(row, i) for row in rows for i in range(self.n))))

    async def _one(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        sample_id = f"{row['prompt_id']}/{index}"
        start = time.time()
        length = self.work.response_length(sample_id, self.max_tokens)
        total = self.work.units(length)
        versions, resumes = await self._generate(total, len(self.work.turn_tokens(length)))
        return {
            **row,
            "sample_id": sample_id,
            "response_ids": [0] * total,
            "response_text": "",
            "response_logprobs": [0.0] * total,
            "token_param_version": versions,
            "param_version": min(versions),
            "param_version_end": max(versions),
            "response_mask": [1] * total,
            "num_tokens": total,
            "num_resumes": resumes,
            "agent_turns": [],
            "finish_reason": "length" if total == self.work.units(self.max_tokens) else "stop",
            "replica": self.replica,
            "generated_time": time.time(),
            "gen_latency_s": time.time() - start,
        }

    async def _generate(self, total: int, turns: int = 1) -> tuple[list[int], int]:
        """Decode `total` tokens (of the logs) in `turns` turns with a tool call between two (the turns of the
        response's simulated length, so a response has as many as in the event model); returns each token's
        version and how often a sync interrupted it."""
        versions: list[int] = []
        resumes = 0
        turns = split(total, turns)
        for turn, tokens in enumerate(turns):
            if turn:  # the tool call: outside any slot, and a sync does not interrupt it
                await asyncio.sleep(self.work.tool_s * self.scale)
            made, interrupted = await self._turn(tokens, first=turn == 0, last=turn == len(turns) - 1)
            versions += made
            resumes += interrupted
        return versions, resumes

    async def _turn(self, total: int, first: bool, last: bool) -> tuple[list[int], int]:
        """One request: decode `total` tokens in a slot."""
        versions: list[int] = []
        resumes = 0
        await self._enter(first)
        try:
            await asyncio.sleep(self.work.prefill_s * self.scale)
            while len(versions) < total:
                version, made = await self._decode(total - len(versions))
                versions += [version] * made
                if len(versions) < total:  # interrupted by a sync: continue with the new weights
                    resumes += 1
                    await self._wait_resumed()
                    if self.pause_mode == "abort":
                        await asyncio.sleep(self.work.prefill_s * self.scale)
        finally:
            await self._leave(last)
        return versions, resumes

    async def _enter(self, first: bool) -> None:
        """A slot, and the request counted in. A request that arrives during a sync waits for its end without
        holding a slot: in wait mode the sync waits for the trajectories already started, whose later turns go on
        during it and need slots."""
        while True:
            await self.slots.acquire()
            async with self.state:
                if not self.paused or (not first and self.pause_mode == "wait"):
                    self.active += int(first)
                    break
            self.slots.release()
            await self._wait_resumed()
        self.busy.request_started()

    async def _leave(self, last: bool) -> None:
        self.busy.request_finished()
        async with self.state:
            self.active -= int(last)
            self.state.notify_all()
        self.slots.release()

    async def _wait_resumed(self) -> None:
        async with self.state:
            await self.state.wait_for(lambda: not self.paused)

    async def _decode(self, remaining: int) -> tuple[int, int]:
        """Decode up to `remaining` tokens; returns (version, tokens made) when done or interrupted by a sync."""
        async with self.state:
            if self.pause_mode != "wait":  # in wait mode a request in flight is never held back: the sync drains it
                await self.state.wait_for(lambda: not self.paused)
            self.decoding += 1
            version = self.version
        per_token = self.work.token_unit * self.work.decode_s_per_token * self.scale
        t0 = time.monotonic()
        try:
            if self.pause_mode == "wait":  # a sync waits for the whole request
                await asyncio.sleep(remaining * per_token)
                return version, remaining
            try:
                await asyncio.wait_for(self.interrupt.wait(), remaining * per_token)
            except TimeoutError:
                return version, remaining
            return version, min(remaining, int((time.monotonic() - t0) / per_token)) if per_token > 0 else remaining
        finally:
            async with self.state:
                self.decoding -= 1
                self.state.notify_all()

    # --- weight syncs, relayed by the VersionClock -----------------------------------------------------------
    async def _control_loop(self, seen: int) -> None:
        while True:
            posted = await self.clock.next_message(seen)
            seen = posted.seq
            if self.replica not in posted.to:
                continue
            self.clock.ack(seen, self.replica, await self._handle(posted))

    async def _handle(self, posted: Posted) -> Ack:
        msg = posted.message
        if isinstance(msg, PushWeights):
            return await self._sync(msg.version)
        if isinstance(msg, Validate):
            return await self._validate(msg, posted.to)
        if isinstance(msg, PullWeights):
            return await self._load()
        return Done(self.replica)  # JoinGroup: a simulated broadcast needs no group

    async def _validate(self, msg: Validate, to: tuple[int, ...]) -> Validated:
        """This replica's share of a validation pass; no sync can start until it is done (pipeline/validate.py)."""
        rows = msg.rows[to.index(self.replica) :: len(to)]
        ids = [f"val-{msg.version}/{row['prompt_id']}/{i}" for row in rows for i in range(msg.n)]
        lengths = [self.work.response_length(sid, self.max_tokens) for sid in ids]
        totals = [self.work.units(length) for length in lengths]
        self.holding += int(not msg.parallel)
        try:
            turns = [len(self.work.turn_tokens(length)) for length in lengths]
            done = await asyncio.gather(*(self._generate(t, k) for t, k in zip(totals, turns, strict=True)))
        finally:
            async with self.state:
                self.holding -= int(not msg.parallel)
                self.state.notify_all()
        samples = [
            {
                "sample_id": sid,
                "prompt_id": row["prompt_id"],
                "data_source": row["data_source"],
                "ground_truth": row["ground_truth"],
                "response_text": "",
                "num_tokens": total,
                "token_param_version": versions,
                "finish_reason": "stop",
            }
            for sid, row, total, (versions, _) in zip(
                ids, [r for r in rows for _ in range(msg.n)], totals, done, strict=True
            )
        ]
        return Validated(self.replica, samples)

    async def _load(self) -> Ack:
        """Pull mode: load the newest published version (the store read costs the sync time), unless held."""
        version, _ = await self.clock.newest_published()
        if version <= self.version:
            return Done(self.replica)
        return await self._sync(version)

    async def _sync(self, version: int) -> Loaded:
        t0 = time.monotonic()
        async with self.state:
            self.paused = True
            if self.pause_mode == "wait":
                await self.state.wait_for(lambda: self.active == 0)  # in-flight requests finish on old weights
            else:
                self.interrupt.set()
                await self.state.wait_for(lambda: self.decoding == 0)
        self.busy.pause()
        t1 = time.monotonic()
        await asyncio.sleep(self.work.sync_time_s() * self.scale)  # the trainer's broadcast, received
        t2 = time.monotonic()
        async with self.state:
            self.version = version
            self.interrupt.clear()
            self.paused = False
            self.state.notify_all()
        self.busy.resume()
        t3 = time.monotonic()
        return Loaded(self.replica, version, time.time(), 1, t1 - t0, t2 - t1, t3 - t2, self.busy.report())
