"""stages/ray_internals.py is the one module that reaches into Ray: every attribute it relies on still exists in the
installed Ray (a failure names the attribute, the function that needs it and the Ray version it was checked against),
no other module reaches in, and the two scheduling switches still do what the stream sets them for."""

import importlib
import inspect
import re
from pathlib import Path

import pytest
import ray

from stages import ray_internals
from stages.ray_internals import RAY_VERSION, USES

ROOT = Path(__file__).resolve().parents[2]
# What reaching into Ray looks like in source: a private module, or a private attribute of a public object.
REACHING_IN = re.compile(
    r"ray\._private|ray\.data\._internal|\._actor_id\b|__ray_call__|_execute_to_iterator|_from_parent|_logical_plan"
)


@pytest.mark.parametrize(("module", "attribute", "user"), USES, ids=[f"{m}:{a}" for m, a, _ in USES])
def test_every_ray_internal_in_use_still_exists(module, attribute, user):
    where = (
        f"stages.ray_internals.{user} needs {module}.{attribute}, checked against Ray {RAY_VERSION} "
        f"(installed: {ray.__version__})"
    )
    try:
        target = importlib.import_module(module)
    except ImportError as err:
        pytest.fail(f"{where}: the module is gone ({err}); adapt {user} to this Ray, or pin Ray {RAY_VERSION}")
    owner, _, name = attribute.rpartition(".")
    if owner:
        assert hasattr(target, owner), f"{where}: {module}.{owner} is gone; adapt {user}, or pin Ray {RAY_VERSION}"
        target = getattr(target, owner)
    if hasattr(target, name):
        return
    # an attribute only an instance gets: set in a method of its class, or a method Ray defines for it
    assert owner and re.search(rf"\b(self\.|def ){re.escape(name)}\b", inspect.getsource(target)), (
        f"{where}: {attribute} is gone; adapt {user}, or pin Ray {RAY_VERSION}"
    )


def test_every_function_named_in_uses_exists():
    assert {user for _, _, user in USES} <= set(dir(ray_internals))


def test_no_other_module_reaches_into_ray():
    sources = [p for d in ("schemas", "stages", "pipeline", "infra", "bench") for p in sorted((ROOT / d).rglob("*.py"))]
    found = {
        f"{p.relative_to(ROOT)}:{n}": line.strip()
        for p in sources
        if p.name != "ray_internals.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if REACHING_IN.search(line)
    }
    assert not found, f"reach Ray's internals through stages/ray_internals.py only: {found}"


def test_ray_data_still_waits_on_the_constant_the_stream_shortens():
    """shorten_scheduling_wait sets Ray Data's scheduling wait by its module-level name; a Ray that read it another
    way would silently bring back 0.1 s per hop."""
    from ray.data._internal.execution import streaming_executor_state

    from pipeline.stream import SCHEDULING_WAIT_S, configure_data_context

    assert "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S" in inspect.getsource(streaming_executor_state.process_completed_tasks)
    configure_data_context(-1)
    assert streaming_executor_state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S == SCHEDULING_WAIT_S


def test_ray_data_fetches_block_metadata_in_its_loop_once_the_stream_says_so():
    """fetch_metadata_in_loop turns Ray Data's metadata thread off by its module-level switch (one round of the
    scheduling loop less per hop); a Ray that read the switch another way would silently bring the thread back."""
    from ray.data._internal.execution import metadata_fetcher

    from pipeline.stream import configure_data_context

    configure_data_context(-1)
    assert isinstance(metadata_fetcher.make_metadata_fetcher(), metadata_fetcher.InlineMetadataFetcher)


class Waits:
    """A stand-in for the `ray` module's wait: `ready` holds the refs that are ready; each call is recorded."""

    def __init__(self, ready: set) -> None:
        self.ready, self.calls = ready, []

    def wait(self, refs, *, num_returns=1, timeout=None, fetch_local=True):
        self.calls.append((list(refs), num_returns, timeout))
        ready = [r for r in refs if r in self.ready]
        return ready, [r for r in refs if r not in self.ready]


def test_the_scheduling_loop_wakes_at_the_first_task_to_finish_not_at_the_last():
    # Ray Data asks for all of them (num_returns 3): "engine" is ready, "gate" and "next" are pending.
    ray_module = Waits({"engine"})
    ready, rest = ray_internals.PromptWait(ray_module).wait(["gate", "engine", "next"], num_returns=3, timeout=0.02)
    assert (ready, rest) == (["engine"], ["gate", "next"])
    first, collect = ray_module.calls
    assert first == (["gate", "engine", "next"], 1, 0.02)  # returns at the first ready, not when all are
    assert collect == (["gate", "engine", "next"], 3, 0)  # then takes every ready one without waiting


def test_a_task_that_stays_ready_does_not_wake_the_loop_again():
    # The engine's output is held back by backpressure: it stays ready. The next call waits for the others only,
    # with the timeout, so the loop does not spin on it.
    ray_module = Waits({"engine"})
    wait = ray_internals.PromptWait(ray_module)
    wait.wait(["gate", "engine"], num_returns=2, timeout=0.02)
    ray_module.calls.clear()
    wait.wait(["gate", "engine"], num_returns=2, timeout=0.02)
    assert ray_module.calls[0] == (["gate"], 1, 0.02)


def test_a_wait_for_one_and_every_other_attribute_pass_through():
    ray_module = Waits({"a"})
    ray_module.get = "ray.get"
    wait = ray_internals.PromptWait(ray_module)
    assert wait.wait(["a", "b"], num_returns=1, timeout=5) == (["a"], ["b"])
    assert ray_module.calls == [(["a", "b"], 1, 5)] and wait.get == "ray.get"


def test_ray_data_waits_through_its_modules_ray_which_the_stream_replaces():
    """wake_on_any_task replaces the `ray` of the scheduling loop's module; a Ray whose loop waited another way
    would silently bring back a full wait per hop."""
    from ray.data._internal.execution import streaming_executor_state

    from pipeline.stream import configure_data_context

    assert "ray.wait(" in inspect.getsource(streaming_executor_state.process_completed_tasks)
    configure_data_context(-1)
    assert isinstance(streaming_executor_state.ray, ray_internals.PromptWait)
    configure_data_context(-1)  # idempotent: not wrapped twice
    assert not isinstance(streaming_executor_state.ray._ray, ray_internals.PromptWait)
