"""A discrete-event model of the fully-async loop, for the planner: milliseconds per run instead of seconds.

It replays the pipeline's rules on stages.sim.workload.Workload's timings, with no Ray and no sleeping: the gate's
permits (the real StalenessBudget), an engine fleet of `slots` sequences fed while fewer than `in_engine` samples
are in it (Ray Data's calls in flight), groups delivered when their n responses are done, the sink's oldest-first
choice and its lag rule, one optimizer step per `required_samples` prompts, and a blocking weight sync every
`trigger_parameter_sync_step` steps: `wait` drains the requests in flight first, `abort`/`keep` freeze them for
the transfer (abort pays the prefill again). A multi-turn response leaves its slot for each tool call and queues
again for its next turn; `wait` drains whole trajectories, later turns included. bench/modes.py checks it against
the real pipeline on sim engines. The gate also keeps verl's bound on the prompts generating at once (the budget's
`concurrency_permits`), beside `in_engine`, Ray Data's bound on the fleet's samples.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from stages.sim.workload import Workload
from stages.staleness import StalenessBudget


@dataclass
class Setting:
    budget: StalenessBudget
    n: int
    max_tokens: int
    slots: int
    """Sequences the whole engine fleet runs at once."""
    in_engine: int
    """Samples admitted into the fleet at most (running or queued for a slot)."""
    pause_mode: str = "wait"


@dataclass
class Outcome:
    wall_s: float
    steps: int
    train_s: float
    sync_s: float
    engine_busy_s: float
    step_end_s: list[float] = field(default_factory=list)
    max_generating: int = 0  # most prompts admitted and not yet generated at once

    @property
    def trainer_idle_ratio(self) -> float:
        return 1 - self.train_s / self.wall_s

    @property
    def rollouter_idle_ratio(self) -> float:
        return 1 - self.engine_busy_s / self.wall_s


@dataclass
class _Sample:
    prompt: int
    turns: list[int]  # simulated tokens of each assistant turn
    turn: int = 0
    done: float = 0.0  # tokens of this turn decoded before the last pause
    finish: float = 0.0
    started: float = 0.0
    epoch: int = 0  # bumped when a pause moves its finish time: stale heap entries are skipped

    @property
    def tokens(self) -> int:
        return self.turns[self.turn]


class _Run:
    def __init__(self, work: Workload, s: Setting, steps: int) -> None:
        self.w, self.s, self.steps = work, s, steps
        self.t = self.version = self.admitted_in_version = self.carried = 0
        self.next_prompt = 0
        self.admit_version: dict[int, int] = {}  # outstanding prompts: admitted, not consumed
        self.left: dict[int, int] = {}  # prompt -> responses still generating
        self.generating = 0  # prompts admitted whose responses are not all done (verl's active tasks)
        self.tokens: dict[int, int] = {}
        self.queue: deque[_Sample] = deque()  # waiting for a slot: admitted, or back from a tool call
        self.active: list[_Sample] = []
        self.in_tool = 0  # samples in a tool call, between two turns
        self.midway = 0  # samples between their first turn's end and their last turn's start
        self.buffer: list[int] = []  # prompts whose group is complete
        self.events: list = []
        self.seq = itertools.count()
        self.paused = self.syncing = self.training = self.moving = False
        self.sync_started = 0.0
        self.step = 0
        self.out = Outcome(0.0, 0, 0.0, 0.0, 0.0)
        self.busy_since: float | None = None

    # --- engine -------------------------------------------------------------------------------------------
    def _admit(self) -> None:
        b = self.s.budget
        while not self.paused and len(self.queue) + len(self.active) + self.in_tool + self.s.n <= self.s.in_engine:
            if min(b.permits(self.admitted_in_version, self.carried), b.concurrency_permits(self.generating)) <= 0:
                return
            p = self.next_prompt
            self.next_prompt += 1
            self.admitted_in_version += 1
            self.generating += 1
            self.out.max_generating = max(self.out.max_generating, self.generating)
            self.admit_version[p], self.left[p], self.tokens[p] = self.version, self.s.n, 0
            for i in range(self.s.n):
                length = self.w.response_length(f"{p}/{i}", self.s.max_tokens)
                self.queue.append(_Sample(p, self.w.turn_tokens(length)))

    def _start(self) -> None:
        """Queued requests into free slots, first come first served; during a sync only the later turns of
        trajectories a `wait` sync drains."""
        free = self.s.slots - len(self.active)
        if not self.paused:
            starting = [self.queue.popleft() for _ in range(min(free, len(self.queue)))]
        elif self.s.pause_mode == "wait" and self.midway:
            starting = [smp for smp in self.queue if smp.turn][: max(0, free)]
            for smp in starting:
                self.queue.remove(smp)
        else:
            starting = []
        for smp in starting:
            self.midway -= int(smp.turn > 0)
            self._schedule(smp, self.w.prefill_s)
            self.active.append(smp)
        self._busy_changed()

    def _schedule(self, smp: _Sample, extra: float) -> None:
        smp.started = self.t + extra
        smp.finish = smp.started + (smp.tokens - smp.done) * self.w.decode_s_per_token
        smp.epoch += 1
        heapq.heappush(self.events, (smp.finish, next(self.seq), "sample", (smp, smp.epoch)))

    def _busy_changed(self) -> None:
        busy = bool(self.active) and not self.paused_engine()  # as EngineBusy counts it in the pipeline
        if busy and self.busy_since is None:
            self.busy_since = self.t
        elif not busy and self.busy_since is not None:
            self.out.engine_busy_s += self.t - self.busy_since
            self.busy_since = None

    def paused_engine(self) -> bool:
        return self.syncing and self.s.pause_mode != "wait"

    def _finished(self, smp: _Sample) -> None:
        self.active.remove(smp)
        if smp.turn + 1 < len(smp.turns):  # a tool call, then the next turn queues for a slot
            smp.turn, smp.done = smp.turn + 1, 0.0
            self.in_tool, self.midway = self.in_tool + 1, self.midway + 1
            heapq.heappush(self.events, (self.t + self.w.tool_s, next(self.seq), "tool", smp))
            return
        self.tokens[smp.prompt] += sum(smp.turns)
        self.left[smp.prompt] -= 1
        if self.left[smp.prompt] == 0:
            self.buffer.append(smp.prompt)
            self.generating -= 1

    # --- trainer --------------------------------------------------------------------------------------------
    def _try_train(self) -> None:
        b = self.s.budget
        if self.training or self.syncing or self.step >= self.steps:
            return
        threshold = self.version - b.lag_bound
        too_old = sum(1 for v in self.admit_version.values() if v <= threshold) if threshold >= 0 else 0
        k = b.trigger_parameter_sync_step
        due = min(b.must_consume_now(too_old, k - 1 - self.step % k), b.required_samples)
        old_here = sum(1 for p in self.buffer if self.admit_version[p] <= threshold)
        if len(self.buffer) < b.required_samples or old_here < due:
            return
        self.buffer.sort(key=lambda p: (self.admit_version[p], p))
        chosen, self.buffer = self.buffer[: b.required_samples], self.buffer[b.required_samples :]
        tokens = sum(self.tokens[p] for p in chosen)
        for p in chosen:
            del self.admit_version[p]
        train = self.w.train_s(tokens, b.require_batches)
        self.training = True
        self.out.train_s += train
        heapq.heappush(self.events, (self.t + train, next(self.seq), "trained", None))

    def _trained(self) -> None:
        self.training = False
        self.step += 1
        self.out.step_end_s.append(self.t)
        if self.step % self.s.budget.trigger_parameter_sync_step == 0:
            self.syncing = self.paused = True  # the gate stops; the engine pauses as its mode says
            self.sync_started = self.t
            if self.s.pause_mode != "wait":
                for smp in self.active:  # frozen where they are; their versions are exact per token
                    smp.done = min(smp.tokens, smp.done + max(0.0, self.t - smp.started) / self.w.decode_s_per_token)
                    smp.epoch += 1
            self._busy_changed()
            self._maybe_transfer()

    def _maybe_transfer(self) -> None:
        drained = not self.active and not self.midway
        if self.syncing and (self.s.pause_mode != "wait" or drained) and not self.moving:
            self.moving = True
            heapq.heappush(self.events, (self.t + self.w.sync_time_s(), next(self.seq), "synced", None))

    def _synced(self) -> None:
        self.moving = False
        self.out.sync_s += self.t - self.sync_started
        self.syncing = self.paused = False
        self.version += 1
        self.carried, self.admitted_in_version = len(self.admit_version), 0
        if self.s.pause_mode != "wait":
            redo = self.w.prefill_s if self.s.pause_mode == "abort" else 0.0
            for smp in self.active:
                self._schedule(smp, redo)
        self._busy_changed()

    def run(self) -> Outcome:
        while self.step < self.steps or self.syncing:  # the last step's sync counts, as in the pipeline
            self._admit()
            self._start()
            self._try_train()
            if not self.events:
                raise RuntimeError("the model stalled: no event left before the last step")
            self.t, _, kind, data = heapq.heappop(self.events)
            if kind == "sample":
                smp, epoch = data
                if epoch == smp.epoch:
                    self._finished(smp)
                    self._busy_changed()
                    self._maybe_transfer()
            elif kind == "tool":
                self.in_tool -= 1
                self.queue.append(data)
            elif kind == "trained":
                self._trained()
            else:
                self._synced()
        self._busy_changed()
        if self.busy_since is not None:
            self.out.engine_busy_s += self.t - self.busy_since
        self.out.wall_s, self.out.steps = self.t, self.step
        return self.out


def simulate(work: Workload, setting: Setting, steps: int) -> Outcome:
    """Simulated seconds and idle times of `steps` trainer steps under `setting`."""
    return _Run(work, setting, steps).run()
