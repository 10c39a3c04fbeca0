"""Replica: one Generate replica's protocol, the same whatever its engine (stages/engines).

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source, agent_name (optional), admitted_version,
                admitted_time
Output columns: input columns, repeated for each of the n responses (the group stays in one block), plus
                sample_id, response_ids, response_text, response_logprobs, token_param_version, param_version,
                param_version_end, response_mask, num_tokens, num_resumes, finish_reason, replica,
                generated_time, gen_latency_s, tool_latency_s, agent_turns, routed_experts and routes_version (null
                without route capture)

Each replica is one Ray Data actor owning one engine. The engine runs on the replica's own event loop thread, so Ray
Data's calls and the control loop (the control plane's messages, relayed by the VersionClock: stages/control.py)
interleave freely: a sync can arrive while calls are in flight. A replica

- joins the stream's replicas (`ClockLink.register_replica`) with the newest weights; after a restart (Ray restarts a
  replica whose process died, and a replica whose engine died ends its own process) it is the same replica, loads
  the newest weights before it takes a prompt, and regenerates the prompts it had in flight (pipeline/replicas.py);
- makes each sample with its `Sampler`: for an engine of tokens the row's agent loop (stages/agents), which drives the
  replica's surface for agent loops (`segment`, `current_version`, `wait_running`), so weight syncs and partial
  rollout stay here and a loop is pure control flow;
- handles the control messages one at a time: joining the trainer's group, a weight swap (pushed or pulled), a
  validation pass. So the next sync waits until a validation pass before it is done, and the weights never change
  under a validation request.

A swap pauses the engine as `pause_mode` says (stages/engines/base.py's PauseMode). Without partial rollout it
pauses in `wait` mode: requests already in the engine finish with the old weights and new ones queue until the new
weights are in (verl's mode c; harmless in the synchronous modes, where nothing is in flight). With partial rollout
it pauses in `abort` mode: each in-flight request ends with its partial tokens and logprobs, and its agent loop
resubmits it at once as prompt + partial tokens with the remaining budget; the paused engine queues it, so it
continues with the new weights (KV recomputed, as in verl and AReaL). In `keep` mode the engine freezes its requests
and continues them after the swap over the KV cache the old weights computed (PipelineRL's in-flight update).
Either way no token is generated twice, none is lost, and the engine's labels say which weights sampled each token.

A push that fails (a replica died during the trainer's broadcast) leaves the replica paused, its weights half
loaded, until the driver forms the group again and repeats the push; a file load that fails leaves the old weights
and the replica goes on with them. Either is acknowledged as `Failed`.

With route capture (MoE models) each sample also carries the experts the engine's routers chose for every token of
prompt + response but the last. They are the routes of the sample's latest engine request, which always covers the
whole context: replaced, never appended, when a response resumes after an abort or an agent loop starts a new turn.
In `keep` mode the frozen request's earlier rows were computed by the old weights and its later ones by the new: its
rows mix weight versions, as its tokens do. So do the rows of tool results that end a trajectory (computed
afterwards, by the weights loaded then; stages.agents.complete_routes).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns
from schemas.sample import GATE_COLUMNS, GENERATE_COLUMNS, PROMPT_COLUMNS, ROUTING_COLUMNS
from stages.agents import Segment, Trajectory, agent_loop_class, check_agent_name, complete_routes
from stages.control import (
    Ack,
    Done,
    Failed,
    JoinGroup,
    Loaded,
    Posted,
    PullWeights,
    PushWeights,
    ReplicaClock,
    Validate,
    Validated,
)
from stages.engines.base import Broadcast, Engine, PauseMode, Sampling, StoreFile, Weights

IN_COLUMNS = [c.name for c in PROMPT_COLUMNS + GATE_COLUMNS]
OUT_COLUMNS = IN_COLUMNS + [c.name for c in GENERATE_COLUMNS + ROUTING_COLUMNS]
OUT_SCHEMA = pa.schema([SAMPLE_SCHEMA.field(c) for c in OUT_COLUMNS])

# The `replica` of the dedicated validation engine's samples; the stream's replicas count from 0.
VALIDATION_REPLICA = -1


class Sampler(Protocol):
    """How a replica makes one sample of a row."""

    async def sample(self, replica: Replica, row: dict[str, Any], sample_id: str) -> tuple[str | None, Trajectory]:
        """A training sample: the agent loop's name and the trajectory."""

    async def validation_sample(
        self, replica: Replica, row: dict[str, Any], sample_id: str, sampling: Sampling
    ) -> Trajectory:
        """A validation sample, at `sampling`."""


class AgentSampler:
    """Each row's agent loop (its agent_name, or the default), built on first use and driven through the replica's
    surface; a validation sample is one engine request on the prompt."""

    def __init__(self, default_agent_loop: str, max_tokens: int, multi_turn: dict[str, Any] | None = None) -> None:
        self.default = check_agent_name(default_agent_loop, "rollout.agent.default_agent_loop")
        self.max_tokens, self.multi_turn, self.loops = max_tokens, multi_turn or {}, {}

    async def sample(self, replica: Replica, row: dict[str, Any], sample_id: str) -> tuple[str, Trajectory]:
        name = row["agent_name"] or self.default
        if name not in self.loops:
            self.loops[name] = agent_loop_class(name)(replica, self.max_tokens, self.multi_turn)
        traj = await self.loops[name].run([int(t) for t in row["prompt_ids"]], sample_id)
        await complete_routes(replica, traj, f"{sample_id}@routes")
        return name, traj

    async def validation_sample(
        self, replica: Replica, row: dict[str, Any], sample_id: str, sampling: Sampling
    ) -> Trajectory:
        traj = Trajectory(list(row["prompt_ids"]))
        seg = await replica.engine.generate(traj.prompt_ids, self.max_tokens, sample_id, sampling)
        traj.add_generated(seg)
        traj.finish_reason = seg.finish_reason
        return traj


class Replica:
    def __init__(
        self,
        clock: ReplicaClock | None,
        engine: Callable[[int], Engine],
        sampler: Sampler,
        n: int,
        sampling: Sampling,
        pause_mode: PauseMode,
        version: int,
        tokenizer: Any = None,
        stage: str = "Generate",
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        """`clock`: None for the dedicated validation engine, outside the stream (it joins neither the clock nor the
        weight-sync group; the driver calls `validate_version`). `engine`: makes the engine for this replica's index
        (it seeds it). `version` labels the engine's starting weights. `tokenizer`: the model's, for an engine of
        tokens (response text, the vocabulary check, the agent loops); None for a simulated one. `stage`: the name
        errors give. `exit`: ends the process when the engine died (Ray then restarts the replica)."""
        self.clock, self.sampler, self.n, self.sampling = clock, sampler, n, sampling
        self.pause_mode, self.tokenizer, self.stage, self.exit = pause_mode, tokenizer, stage, exit
        self.vocab_size = None if tokenizer is None else len(tokenizer)
        self.index = VALIDATION_REPLICA if clock is None else clock.reserve_replica(clock.actor_id)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True).start()
        self.engine = engine(self.index)
        self.run(self._start(version))
        if clock is not None:
            self._join(clock)

    def run(self, coro: Any) -> Any:
        """Run `coro` on the engine's loop and wait for it, from another thread."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _start(self, version: int) -> None:
        await self.engine.start(version)
        # Created on the engine loop, which uses them.
        self.loaded, self.loaded_changed = version, asyncio.Condition()
        self.holding = 0  # validation shares that hold new training requests (parallel_validate_and_rollout=false)
        self.one_pass = asyncio.Lock()  # the dedicated engine: one version's pass at a time
        self.running = asyncio.Event()  # cleared while a swap is under way: agent loops wait at their next state
        self.running.set()

    def _join(self, clock: ReplicaClock) -> None:
        """Become a member of the stream's replicas, with the newest weights; messages are read from the
        registration on (the ones before were for the process this one may replace)."""
        reg = clock.register_replica(clock.actor_id, os.getpid(), clock.node_id, self.engine.processes())
        if reg.version != self.loaded:  # a restart: never serve the initial weights under a newer version's name
            self.run(self._load_at_start(reg.version, reg.url))
        self.control = asyncio.run_coroutine_threadsafe(self._control_loop(reg.seq), self.loop)
        self.watchdog = asyncio.run_coroutine_threadsafe(self._watch(), self.loop)

    async def _load_at_start(self, version: int, url: str) -> None:
        await self.engine.load(StoreFile(url), version)
        self.loaded = version

    async def _watch(self) -> None:
        """End this replica once its engine has died, whatever it was doing (a call into a dead engine may never
        return, and an idle replica would notice only at its next request)."""
        cause = await self.engine.watch()
        await asyncio.to_thread(self._exit, cause)

    def _exit(self, cause: str) -> None:
        """End this replica's process so that Ray restarts it with a new engine and retries its calls; an engine
        that died takes no more requests. The clock logs the restart with `cause`."""
        try:
            if self.clock is not None:
                self.clock.replica_failed(self.index, cause)
        finally:
            print(f"Generate replica {self.index}: {cause}; exiting for Ray to restart it", flush=True)
            self.exit(1)

    def _died(self, err: BaseException) -> str | None:
        return f"its {self.engine.name} engine died ({type(err).__name__})" if self.engine.died(err) else None

    def shutdown(self) -> None:
        self.engine.shutdown()

    # --- the stream's calls -----------------------------------------------------------------------------------
    async def generate(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, [c for c in IN_COLUMNS if c != "agent_name"], self.stage)
        if "agent_name" not in batch.column_names:  # optional: hand-built batches get the default loop
            batch = batch.append_column("agent_name", pa.nulls(batch.num_rows, pa.string()))
        rows = batch.select(IN_COLUMNS).to_pylist()
        if self.vocab_size is not None:
            for row in rows:  # an out-of-range id kills an engine: refuse it here, by name
                bad = [t for t in row["prompt_ids"] if not 0 <= t < self.vocab_size]
                if bad:
                    raise ValueError(f"prompt {row['prompt_id']} has token ids {bad[:5]} outside the vocabulary")
        prompt_ids = [row["prompt_id"] for row in rows]
        if self.clock is not None:
            self.clock.generating(self.index, prompt_ids)  # re-admitted if this replica dies meanwhile
        future = asyncio.run_coroutine_threadsafe(self._generate_rows(rows), self.loop)
        try:
            out_rows = await asyncio.wrap_future(future)
        except Exception as err:
            if (cause := self._died(err)) is not None:
                self._exit(cause)
            raise
        if self.clock is not None:
            self.clock.generated(self.index, prompt_ids)
        return pa.Table.from_pylist(out_rows, schema=OUT_SCHEMA)

    async def _generate_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Pull mode: prompts admitted at a version this replica has not loaded yet wait for it (the lag bound).
        need = max(row["admitted_version"] for row in rows)
        async with self.loaded_changed:
            await self.loaded_changed.wait_for(lambda: self.loaded >= need and not self.holding)
        return list(await asyncio.gather(*(self._one(row, i) for row in rows for i in range(self.n))))

    async def _one(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        sample_id = f"{row['prompt_id']}/{index}"
        start = time.time()
        agent, traj = await self.sampler.sample(self, row, sample_id)
        tokens, versions = traj.tokens, traj.versions
        return {
            **row,
            "agent_name": agent,
            "sample_id": sample_id,
            "response_ids": tokens,
            "response_text": self._text(tokens),
            "response_logprobs": traj.logprobs,
            "token_param_version": versions,
            "param_version": min(versions, default=row["admitted_version"]),
            "param_version_end": max(versions, default=row["admitted_version"]),
            "response_mask": traj.mask,
            "num_tokens": len(tokens),
            "num_resumes": traj.num_resumes,
            "finish_reason": traj.finish_reason,
            "replica": self.index,
            "generated_time": time.time(),
            "gen_latency_s": time.time() - start,
            "tool_latency_s": sum(t["latency_s"] or 0.0 for t in traj.turns if t["role"] == "tool"),
            "agent_turns": traj.turns,
            "routed_experts": None if traj.routes is None else traj.routes.tolist(),
            "routes_version": None if traj.routes is None else traj.routes_version,
        }

    def _text(self, tokens: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(tokens, skip_special_tokens=True)

    # --- what an agent loop may ask of the replica (stages.agents.AgentEngine) ---------------------------------
    async def segment(self, context: list[int], max_tokens: int, request_id: str) -> Segment:
        return await self.engine.generate(context, max_tokens, request_id, self.sampling)

    def current_version(self) -> int:
        return self.loaded

    async def wait_running(self) -> bool:
        if self.running.is_set():
            return False
        await self.running.wait()
        return True

    # --- control messages, relayed by the VersionClock -------------------------------------------------------
    async def _control_loop(self, seen: int) -> None:
        while True:
            posted = await self.clock.next_message(seen)
            seen = posted.seq
            if self.index not in posted.to:
                continue  # posted before this replica joined: a group or a version it never had
            try:
                ack = await self._handle(posted)
            except Exception as err:
                if (cause := self._died(err)) is not None:
                    await asyncio.to_thread(self._exit, cause)
                ack = Failed(self.index, f"{type(err).__name__}: {err}")
            self.clock.ack(seen, self.index, ack)

    async def _handle(self, posted: Posted) -> Ack:
        msg = posted.message
        if isinstance(msg, JoinGroup):
            await self.engine.join(msg.address, msg.ranks[self.index], msg.world_size)
            return Done(self.index)
        if isinstance(msg, PushWeights):
            return await self._swap(msg.version, Broadcast(msg.meta))
        if isinstance(msg, PullWeights):
            version, url = await self.clock.newest_published()  # the newest, which may be newer than msg.version
            return Done(self.index) if version <= self.loaded else await self._swap(version, StoreFile(url))
        if isinstance(msg, Validate):
            return await self._validate(msg, posted.to)
        raise TypeError(f"no handler for control message {msg!r}")

    async def _swap(self, version: int, weights: Weights) -> Loaded | Failed:
        pushed = isinstance(weights, Broadcast)
        self.running.clear()
        try:
            return await self._paused_swap(version, weights)
        except Exception as err:
            if self.engine.died(err) or not pushed:
                raise
            # The trainer gave up on this broadcast (a replica died during it) and closed the group, and it will
            # form the group again and repeat the push: stay paused, weights half loaded, until then.
            return Failed(self.index, f"{type(err).__name__}: {err}")
        finally:  # a loop waiting for the swap's end must not wait forever, unless the push is to be repeated
            if self.loaded == version or not pushed:
                self.running.set()

    async def _paused_swap(self, version: int, weights: Weights) -> Loaded:
        t0 = time.monotonic()
        await self.engine.pause(self.pause_mode)
        t1 = time.monotonic()
        try:
            ranks = await self.engine.load(weights, version)
        except Exception:
            if not isinstance(weights, Broadcast):  # a failed file load leaves the old weights: go on with them
                await self.engine.resume()
            raise
        t2 = time.monotonic()
        await self.engine.resume()
        async with self.loaded_changed:
            self.loaded = version
            self.loaded_changed.notify_all()
        t3 = time.monotonic()
        return Loaded(self.index, version, time.time(), ranks, t1 - t0, t2 - t1, t3 - t2, self.engine.busy.report())

    # --- validation ----------------------------------------------------------------------------------------------
    async def validate_version(self, msg: Validate) -> Validated:
        """The dedicated engine's pass: load the version's weight file unless it holds it, then generate every row.
        One pass at a time, so the weights cannot change under a validation request."""

        async def one_pass() -> Validated:
            async with self.one_pass:
                if msg.version != self.loaded:
                    await self._swap(msg.version, StoreFile(msg.url))
                return await self._validate(msg, (self.index,))

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(one_pass(), self.loop))

    async def _validate(self, msg: Validate, to: tuple[int, ...]) -> Validated:
        """This replica's share of a validation pass (pipeline/validate.py): every len(to)-th row. Unless `parallel`,
        training requests not yet started wait until the share is done."""
        rows = msg.rows[to.index(self.index) :: len(to)]
        hold = not msg.parallel and self.clock is not None
        self.holding += int(hold)
        try:
            jobs = [self._val_one(row, i, msg) for row in rows for i in range(msg.n)]
            return Validated(self.index, list(await asyncio.gather(*jobs)))
        finally:
            async with self.loaded_changed:
                self.holding -= int(hold)
                self.loaded_changed.notify_all()

    async def _val_one(self, row: dict[str, Any], index: int, msg: Validate) -> dict[str, Any]:
        sample_id = f"val-{msg.version}/{row['prompt_id']}/{index}"
        start = time.time()
        traj = await self.sampler.validation_sample(self, row, sample_id, Sampling(msg.temperature, msg.top_p))
        return {
            "sample_id": sample_id,
            "prompt_id": row["prompt_id"],
            "data_source": row["data_source"],
            "ground_truth": row["ground_truth"],
            "response_text": self._text(traj.tokens),
            "num_tokens": len(traj.tokens),
            "token_param_version": traj.versions,
            "finish_reason": traj.finish_reason,
            "replica": self.index,
            "started_time": start,
            "generated_time": time.time(),
        }
