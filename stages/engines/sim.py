"""SimEngine: an Engine (stages/engines/base.py) that spends time instead of compute, and SimSampler, the simulated
workload's responses made on it.

The model is stages.sim.workload.Workload: `slots` sequences at once, a prefill, then a fixed time per token. A
response's length is drawn per sample id and decoded in the workload's turns, with a tool call between two turns
that takes no slot (`trajectory`). A pause behaves as its mode says. `wait`: trajectories already started finish with
the old weights (their later turns go on during the pause), new ones queue. `abort`: every sequence stops where it
is, keeps its tokens and continues after the swap with the new weights, paying its prefill again (KV recomputed).
`keep`: the same without the second prefill. Tokens are labelled with the version that was loaded while they were
decoded, exactly as the real engine does. Token ids are 0 and logprobs 0.0: only lengths, times and versions mean
anything here.

A weight load takes the workload's sync time whatever the weights (a push's broadcast, a file), and the trainer's
side takes the same time (stages/sim/trainer.py); a simulated broadcast needs no group, so `join` does nothing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from stages.agents import Segment, Trajectory
from stages.engine_busy import EngineBusy
from stages.engines.base import PauseMode, Sampling, Weights
from stages.sim.workload import Workload, split
from stages.transports import GroupAddress


class SimEngine:
    name = "simulated"

    def __init__(self, work: Workload, interruptible: bool = True) -> None:
        """`interruptible`: the replica pauses in abort or keep mode, so a decode must be able to stop midway; in
        wait mode it runs to its end, and sleeps for it."""
        self.work, self.scale, self.interruptible = work, work.time_scale, interruptible

    async def start(self, version: int) -> None:
        # Created on the engine's loop: asyncio primitives belong to the loop that uses them.
        self.version = version
        self.slots = asyncio.Semaphore(self.work.slots)
        self.state = asyncio.Condition()
        self.paused = False  # a swap is under way: no new request and (abort/keep) no new token
        self.mode = PauseMode.WAIT  # the latest pause's
        self.interrupt = asyncio.Event()  # set at the start of an abort/keep pause: decoders stop where they are
        self.active = 0  # trajectories started and not finished (a wait-mode pause drains these)
        self.decoding = 0  # requests inside a decode segment (abort/keep pauses wait until these stop)
        self.busy = EngineBusy()

    # --- requests -------------------------------------------------------------------------------------------
    async def generate(self, prompt: list[int], max_tokens: int, request_id: str, sampling: Sampling) -> Segment:
        """One request of `max_tokens` simulated tokens, as one turn: an abort-mode pause ends it early with
        finish_reason 'abort', as the real engine's does."""
        total = self.work.units(max_tokens)
        versions, _ = await self._turn(total, first=True, last=True, resume_inside=False)
        finish = "length" if len(versions) == total else "abort"
        return Segment([0] * len(versions), [0.0] * len(versions), versions, finish, None, self.version)

    async def trajectory(self, total: int, turns: int = 1) -> tuple[list[int], int]:
        """Decode `total` tokens (of the logs) in `turns` turns with a tool call between two (the turns of the
        response's simulated length, so a response has as many as in the event model); returns each token's
        version and how often a swap interrupted it."""
        versions: list[int] = []
        resumes = 0
        parts = split(total, turns)
        for turn, tokens in enumerate(parts):
            if turn:  # the tool call: outside any slot, and a swap does not interrupt it
                await asyncio.sleep(self.work.tool_s * self.scale)
            made, interrupted = await self._turn(tokens, first=turn == 0, last=turn == len(parts) - 1)
            versions += made
            resumes += interrupted
        return versions, resumes

    async def _turn(self, total: int, first: bool, last: bool, resume_inside: bool = True) -> tuple[list[int], int]:
        """One request: decode `total` tokens in a slot. Interrupted by an abort- or keep-mode pause, it continues
        after the swap (`resume_inside`; an abort pays the prefill again), or it ends there."""
        versions: list[int] = []
        resumes = 0
        await self._enter(first)
        try:
            await asyncio.sleep(self.work.prefill_s * self.scale)
            while len(versions) < total:
                version, made = await self._decode(total - len(versions))
                versions += [version] * made
                if len(versions) < total:  # interrupted by a swap
                    if not resume_inside and self.mode == PauseMode.ABORT:
                        break
                    resumes += 1
                    await self._wait_resumed()
                    if self.mode == PauseMode.ABORT:
                        await asyncio.sleep(self.work.prefill_s * self.scale)
        finally:
            await self._leave(last)
        return versions, resumes

    async def _enter(self, first: bool) -> None:
        """A slot, and the request counted in. A request that arrives during a swap waits for its end without
        holding a slot: in wait mode the swap waits for the trajectories already started, whose later turns go on
        during it and need slots."""
        while True:
            await self.slots.acquire()
            async with self.state:
                if not self.paused or (not first and self.mode == PauseMode.WAIT):
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
        """Decode up to `remaining` tokens; returns (version, tokens made) when done or interrupted by a swap."""
        async with self.state:
            if self.mode != PauseMode.WAIT:  # in wait mode a request in flight is never held back: it drains
                await self.state.wait_for(lambda: not self.paused)
            self.decoding += 1
            self.state.notify_all()  # whoever waits on the count looks again
            version = self.version
        per_token = self.work.token_unit * self.work.decode_s_per_token * self.scale
        t0 = time.monotonic()
        try:
            if not self.interruptible:  # a wait-mode pause waits for the whole request
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

    # --- weight swaps ---------------------------------------------------------------------------------------
    async def pause(self, mode: PauseMode) -> None:
        async with self.state:
            self.paused, self.mode = True, mode
            if mode == PauseMode.WAIT:
                await self.state.wait_for(lambda: self.active == 0)  # in-flight requests finish on old weights
            else:
                self.interrupt.set()
                await self.state.wait_for(lambda: self.decoding == 0)
        self.busy.pause()

    async def load(self, weights: Weights, version: int) -> int:
        await asyncio.sleep(self.work.sync_time_s() * self.scale)  # the trainer's broadcast, received
        self.version = version
        return 1

    async def resume(self) -> None:
        async with self.state:
            self.interrupt.clear()
            self.paused = False
            self.state.notify_all()
        self.busy.resume()

    async def join(self, group: GroupAddress, rank: int, world_size: int) -> None:
        return None

    async def watch(self) -> str:
        await asyncio.Event().wait()  # a simulated engine does not die
        return ""

    def died(self, err: BaseException) -> bool:
        return False

    def processes(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        return None


class SimSampler:
    """The simulated workload's samples: a length drawn per sample id (stages/sim/workload.py), decoded as
    `SimEngine.trajectory`; validation samples alike."""

    def __init__(self, engine: SimEngine, max_tokens: int) -> None:
        self.engine, self.work, self.max_tokens = engine, engine.work, max_tokens

    async def sample(self, replica: Any, row: dict[str, Any], sample_id: str) -> tuple[str | None, Trajectory]:
        return row.get("agent_name"), await self._trajectory(row, sample_id)

    async def validation_sample(
        self, replica: Any, row: dict[str, Any], sample_id: str, sampling: Sampling
    ) -> Trajectory:
        return await self._trajectory(row, sample_id)

    async def _trajectory(self, row: dict[str, Any], sample_id: str) -> Trajectory:
        length = self.work.response_length(sample_id, self.max_tokens)
        total = self.work.units(length)
        versions, resumes = await self.engine.trajectory(total, len(self.work.turn_tokens(length)))
        traj = Trajectory(list(row["prompt_ids"]), [0] * total, [0.0] * total, versions, [1] * total)
        traj.num_resumes = resumes
        traj.finish_reason = "length" if total == self.work.units(self.max_tokens) else "stop"
        return traj
