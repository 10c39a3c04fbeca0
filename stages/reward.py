"""Reward: score each response in worker processes, concurrently, and kill a scorer that hangs.

Input columns:  sample_id, response_text, ground_truth, data_source (agent_turns and reward_sources too, when
                present: a custom function's extra_info["num_turns"] and ["reward_scores"] come from them;
                num_tokens with the dapo manager's overlong buffer)
Output columns: input columns + reward (float32), reward_error (string, null when scoring succeeded),
                reward_extra_info (string: a JSON object, as the reward manager makes it; null when scoring failed)

What scores a sample is stages/verifiers.score_sample: the verifier of its data source, or for every sample the
custom reward function when one is configured (verl's `reward.custom_reward_function`); the reward manager
(stages/reward_manager.py, verl's `reward.reward_manager.name`) then makes its reward of the score. A scorer that
raises, returns a non-number (or, for a built-in verifier, a value outside [0, 1]), or runs past `timeout_s` marks
that sample (reward 0 and the reason in reward_error); it never fails the run.

Why processes: a thread cannot be killed, so a hung verifier would hold its thread (and CPU) for the rest of the
run, and math-verify's own timeouts use SIGALRM, which only a process's main thread may set. So the stage owns
`num_workers` worker processes, forked lazily in the process that runs it (and again after a fork of that
process). A block's samples are handed out one at a time to whichever worker is free; a worker past its sample's
deadline is SIGKILLed and replaced by a fresh one, a worker that dies marks its sample. Workers end with the stage
(close(), or when it is collected, or at exit), and on their own when their parent dies: the kernel kills them
(PR_SET_PDEATHSIG on Linux) and a worker waiting for work exits when its pipe closes. A custom function is named by
path and name, never pickled; it is loaded once in the parent before the first fork, so every worker starts with
it (and with math-verify imported, when the block has math data).

The stage stays a plain callable class: Ray Data pickles it without its workers and runs it as a task stage.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns
from stages import math_verifier
from stages.fate import die_with
from stages.reward_manager import RewardManager
from stages.verifiers import MATH_SOURCES, load_score_function, score_sample

_NEEDS = ["sample_id", "response_text", "ground_truth", "data_source"]
Score = tuple[float, str | None, str | None]  # reward, reward_error, reward_extra_info

# The parent ends of every worker's pipe in this process: a new worker closes its copies, so that a worker waiting
# for work sees its pipe close when its parent dies, whichever worker was forked last.
_PARENT_ENDS: set[Connection] = set()


class Reward:
    def __init__(
        self,
        timeout_s: float = 30.0,
        num_workers: int = 2,
        custom_path: str = "",
        custom_name: str = "compute_score",
        reward_kwargs: dict[str, Any] | None = None,
        manager: RewardManager | None = None,
    ) -> None:
        """`timeout_s` bounds one sample's scoring (math-verify's own limits, 5 s per parse or comparison, come
        first); `custom_*` and `reward_kwargs` are verl's `custom_reward_function.path`, `.name`, `.reward_kwargs`;
        `manager` is verl's reward manager (naive by default)."""
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"Reward needs num_workers >= 1 and timeout_s > 0, got {num_workers} and {timeout_s}")
        self.timeout_s, self.num_workers = timeout_s, num_workers
        self.custom_path, self.custom_name = custom_path, custom_name
        self.reward_kwargs = dict(reward_kwargs or {})
        self.manager = manager or RewardManager()
        self._workers: list[_Worker] = []
        self._owner_pid = -1  # the process that forked self._workers
        self._finalizer: weakref.finalize | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Ray Data ships the stage to other processes: they start workers of their own.
        return {**self.__dict__, "_workers": [], "_owner_pid": -1, "_finalizer": None}

    def __call__(self, batch: pa.Table) -> pa.Table:
        lengths = ["num_tokens"] if self.manager.shapes_length else []
        require_columns(batch, _NEEDS + lengths, "Reward")
        # A custom function's extra_info: num_turns from agent_turns, reward_scores from the model sources' records.
        extra = ("agent_turns", "reward_sources")
        columns = _NEEDS + [c for c in extra if self.custom_path and c in batch.column_names]
        rows = batch.select(columns).to_pylist()
        tokens = batch["num_tokens"].to_pylist() if lengths else [None] * len(rows)
        raw = self._score_all(rows) if rows else []
        scores = [self.manager.shape(*score, n) for score, n in zip(raw, tokens, strict=True)]
        rewards, errors, extras = zip(*scores, strict=True) if scores else ((), (), ())
        batch = batch.append_column(SAMPLE_SCHEMA.field("reward"), pa.array(rewards, pa.float32()))
        batch = batch.append_column(SAMPLE_SCHEMA.field("reward_error"), pa.array(errors, pa.string()))
        return batch.append_column(SAMPLE_SCHEMA.field("reward_extra_info"), pa.array(extras, pa.string()))

    def close(self) -> None:
        """End the worker processes (a later call starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
        self._workers, self._owner_pid, self._finalizer = [], -1, None

    def worker_pids(self) -> list[int]:
        """PIDs of the live worker processes of this process's pool."""
        return [w.pid for w in self._workers] if self._owner_pid == os.getpid() else []

    def _score_all(self, rows: list[dict[str, Any]]) -> list[Score]:
        """Each row's score, handing rows to free workers and replacing a worker that hangs or dies."""
        custom_error = self._start(any(row["data_source"] in MATH_SOURCES for row in rows))
        if custom_error is not None:
            return [(0.0, custom_error, None)] * len(rows)
        scores: list[Score | None] = [None] * len(rows)
        todo = deque(range(len(rows)))
        while todo or any(w.job is not None for w in self._workers):
            for worker in self._workers:
                if worker.job is None and todo:
                    if not worker.send(todo[0], rows[todo[0]], time.monotonic() + self.timeout_s):
                        self._replace(worker)  # died while idle (e.g. its parent thread ended): retry on a fresh one
                        continue
                    todo.popleft()
            busy = [w for w in self._workers if w.job is not None]
            if not busy:
                continue
            soonest = min(w.deadline for w in busy)
            ready = wait([w.conn for w in busy], timeout=max(0.0, soonest - time.monotonic()))
            for worker in busy:
                if worker.conn in ready:
                    job = worker.job  # receive() frees the worker
                    scores[job] = worker.receive()
                    if not worker.alive:
                        self._replace(worker)
                elif time.monotonic() >= worker.deadline:
                    scores[worker.job] = (0.0, f"timed out after {self.timeout_s}s (its process was killed)", None)
                    self._replace(worker)
        return scores

    def _start(self, math: bool) -> str | None:
        """Fork the workers if this process has none; the custom function's load error, if any."""
        if math and not self.custom_path:
            math_verifier.warm()  # once per process: workers forked from now on start with it
        if self._owner_pid == os.getpid() and self._workers:
            return None
        if self.custom_path:
            try:
                load_score_function(self.custom_path, self.custom_name)  # cached: the workers inherit it
            except ValueError as err:
                return str(err)
        self._workers, self._owner_pid = [], os.getpid()
        self._workers += [self._fork() for _ in range(self.num_workers)]
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._owner_pid)
        return None

    def _fork(self) -> _Worker:
        return _Worker.fork(self.custom_path, self.custom_name, self.reward_kwargs)

    def _replace(self, worker: _Worker) -> None:
        worker.stop()
        self._workers[self._workers.index(worker)] = self._fork()


class _Worker:
    """One forked scoring process, the parent end of its pipe, and the sample it is scoring (job, deadline)."""

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid, self.conn = pid, conn
        self.job: int | None = None
        self.deadline = 0.0
        self.alive = True

    @classmethod
    def fork(cls, custom_path: str, custom_name: str, reward_kwargs: dict[str, Any]) -> _Worker:
        parent_end, child_end = Pipe()
        parent_pid = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the caller's code
            code = 1
            try:
                parent_end.close()
                for conn in _PARENT_ENDS:
                    conn.close()
                die_with(parent_pid)
                _serve(child_end, custom_path, custom_name, reward_kwargs)
                code = 0
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        child_end.close()
        _PARENT_ENDS.add(parent_end)
        return cls(pid, parent_end)

    def send(self, job: int, row: dict[str, Any], deadline: float) -> bool:
        """Hand the worker a row; False when it is gone."""
        try:
            self.conn.send(row)
        except OSError:
            self.alive = False
            return False
        self.job, self.deadline = job, deadline
        return True

    def receive(self) -> Score:
        """The score of the worker's row, or the reason it has none (the worker died)."""
        try:
            score = self.conn.recv()
        except (EOFError, OSError):
            self.alive = False
            score = (0.0, f"scoring process died ({_exit_status(self.pid)})", None)
        self.job = None
        return score

    def stop(self) -> None:
        """SIGKILL the worker and reap it."""
        _PARENT_ENDS.discard(self.conn)
        self.conn.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _exit_status(self.pid)
        self.alive = False


def _serve(conn: Connection, custom_path: str, custom_name: str, reward_kwargs: dict[str, Any]) -> None:
    """The worker's loop: score each row it is sent, until its pipe closes."""
    custom = load_score_function(custom_path, custom_name) if custom_path else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it kills the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler (Ray's, say): just end
    while True:
        try:
            row = conn.recv()
        except (EOFError, OSError):
            return
        try:
            score = score_sample(row, custom, reward_kwargs)
        except Exception as err:  # noqa: BLE001 - e.g. extra keys JSON cannot hold: the sample's, not the worker's
            score = (0.0, f"scoring failed: {type(err).__name__}: {err}"[:2000], None)
        conn.send(score)


def _exit_status(pid: int) -> str:
    """Reap `pid` (blocking) and describe how it ended."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:  # already reaped (SIGCHLD ignored)
        return "exit status unknown"
    code = os.waitstatus_to_exitcode(status)
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


def _stop(workers: list[_Worker], owner_pid: int) -> None:
    """Kill a pool's workers: only in the process that forked them (a forked copy of the stage owns none)."""
    if os.getpid() == owner_pid:
        for worker in workers:
            worker.stop()
        workers.clear()
