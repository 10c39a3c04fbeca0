"""The StalenessGate's calls (stages/gate.py): admitted one at a time in Ray Data's dispatch order, whichever of its
actor's two threads runs them first, and the end marker's call, which waits for the trainer, holds no other call
back, also when Ray Data dispatched it before the last prompts' block. A stand-in clock (pure logic): it admits
every prompt at once and records the order it was asked in."""

import threading
import time

import pyarrow as pa
from ray.data._internal.execution.interfaces.task_context import TaskContext

from pipeline.stream import _gate
from pipeline.tasks.admission import end_block
from schemas.sample import PROMPT_COLUMNS
from stages.gate import StalenessGate, Turns

WAIT_S = 10  # a bound on a thread's join, never reached when the gate works


class Clock:
    def __init__(self) -> None:
        self.asked: list[list[str]] = []
        self.closed = threading.Event()
        self.waiting = threading.Event()

    def acquire(self, prompt_ids: list[str]) -> tuple[int, list[str]]:
        self.asked.append(list(prompt_ids))
        return 0, list(prompt_ids)

    def wait_closed(self) -> None:
        self.waiting.set()
        assert self.closed.wait(WAIT_S)


def _gate_with(clock: Clock) -> StalenessGate:
    gate = StalenessGate.__new__(StalenessGate)
    gate.clock, gate.turns = clock, Turns()
    return gate


def _block(*ids: str) -> pa.Table:
    return pa.table(
        {c.name: pa.array([i if c.name == "prompt_id" else None for i in ids], c.type) for c in PROMPT_COLUMNS}
    )


def _call(gate: StalenessGate, batch: pa.Table, index: int, out: dict) -> threading.Thread:
    """Run the gate on `batch` as Ray Data's task `index` in a thread of its own, its output into out[index]."""

    def run():
        with TaskContext.current(TaskContext(task_idx=index, op_name="gate")):
            out[index] = [i for t in gate(batch) for i in t["prompt_id"].to_pylist()]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _waits_for_its_turn(turns: Turns, clock: Clock) -> bool:
    """True once a call waits on the turns' condition; False if it asked the clock without waiting."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and not clock.asked:
        with turns.changed:
            if turns.changed._waiters:  # threading.Condition's own list of waiting threads
                return True
    return False


def test_calls_admit_in_dispatch_order_whichever_thread_runs_first():
    clock, out = Clock(), {}
    gate = _gate_with(clock)
    later = _call(gate, _block("c", "d"), 1, out)  # task 1 runs first: it waits for task 0's turn
    assert _waits_for_its_turn(gate.turns, clock)
    first = _call(gate, _block("a", "b"), 0, out)
    for thread in (first, later):
        thread.join(WAIT_S)
    assert clock.asked == [["a", "b"], ["c", "d"]] and out == {0: ["a", "b"], 1: ["c", "d"]}


def test_an_end_marker_dispatched_before_the_last_block_does_not_hold_it_back():
    clock, out = Clock(), {}
    gate = _gate_with(clock)
    before = _call(gate, _block("a", "b"), 0, out)
    end = _call(gate, end_block(), 1, out)
    assert clock.waiting.wait(WAIT_S)  # the marker's call waits for the trainer
    last = _call(gate, _block("y", "z"), 2, out)
    last.join(WAIT_S)
    assert not last.is_alive() and out[2] == ["y", "z"]  # admitted while the marker waits
    assert end.is_alive() and 1 not in out
    clock.closed.set()
    end.join(WAIT_S)
    before.join(WAIT_S)
    assert out[1] == [] and clock.asked == [["a", "b"], ["y", "z"]]


def test_outside_ray_data_a_call_takes_no_turn():
    clock = Clock()
    gate = _gate_with(clock)
    assert [t["prompt_id"].to_pylist() for t in gate(_block("a"))] == [["a"]]
    assert gate.turns.next == 0


def test_the_gate_actor_runs_two_calls_at_once():
    class Where:
        def head_resources(self):
            return {}

    stage = _gate(type("Inputs", (), {"clock": ("clock", "ns"), "where": Where()})())
    assert stage.options["max_concurrency"] == 2  # one for the end marker's wait, one for the blocks
    assert stage.options["compute"].max_tasks_in_flight_per_actor == 2
