"""Every use of a Ray internal in this project, in one place, each checked against Ray 2.60.0.

Ray's public API does not reach a few things a long-running stream needs: the scheduling loop's waits, a block
repartition that keeps order without a CPU, the bundle iterator with its executor (to hand over block references
and stop the stream), an actor's restart count without the dashboard, and switches that keep Ray on loopback and off
a second local instance. Each is reached only through a function here, which says what it relies on and why.
`USES` lists every (module, attribute) these functions touch; tests/unit/test_ray_internals.py imports each one and
fails with a message naming it and the function here when a Ray upgrade removes or renames it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

RAY_VERSION = "2.60.0"  # the Ray every use below was checked against

# (module, attribute, the function here that needs it). An attribute of a class is "Class.attribute"; one that only
# an instance gets (set in a method, or a method Ray adds to every actor class) is looked for in the owner's source.
USES: list[tuple[str, str, str]] = [
    (
        "ray.data._internal.execution.streaming_executor_state",
        "WAIT_FOR_TASK_COMPLETION_TIMEOUT_S",
        "shorten_scheduling_wait",
    ),
    ("ray.data._internal.execution.streaming_executor_state", "ray", "wake_on_any_task"),
    ("ray.data._internal.execution.metadata_fetcher", "_PREFETCH_ON_THREAD", "fetch_metadata_in_loop"),
    ("ray.data._internal.compute", "TaskPoolStrategy", "repartition_in_order"),
    ("ray.data._internal.logical.interfaces", "LogicalPlan", "repartition_in_order"),
    ("ray.data._internal.logical.operators", "StreamingRepartition", "repartition_in_order"),
    ("ray.data.dataset", "Dataset._from_parent", "repartition_in_order"),
    ("ray.data.dataset", "Dataset._logical_plan", "repartition_in_order"),
    ("ray.data.dataset", "Dataset._execute_to_iterator", "bundle_iterator"),
    ("ray.data._internal.execution.interfaces.task_context", "TaskContext.get_current", "map_task_index"),
    ("ray.data._internal.execution.streaming_executor", "StreamingExecutor", "wait_for_data_threads"),
    ("ray.data._internal.execution.streaming_executor", "StreamingExecutor.shutdown", "bundle_iterator"),
    ("ray.data._internal.execution.streaming_executor", "StreamingExecutor._topology", "executor_metrics"),
    ("ray._private.state", "actors", "actor_state"),
    ("ray._private.auto_init_hook", "enable_auto_connect", "no_auto_connect"),
    ("ray._private.runtime_env.constants", "RAY_JOB_CONFIG_JSON_ENV_VAR", "job_env_vars"),
    ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER", "keep_ray_on_loopback"),
    ("ray.actor", "ActorHandle._actor_id", "actor_id"),
    ("ray.actor", "_modify_class.__ray_call__", "call_on_actor"),
    ("ray._private.node", "Node", "worker_node_classes"),
    ("ray._private.parameter", "RayParams", "worker_node_classes"),
    ("ray._private.authentication.authentication_token_setup", "ensure_token_if_auth_enabled", "worker_node_classes"),
]

# Ray Data threads in the driver that end once the stream's iterator is closed and may touch Ray until they do.
DATA_THREADS = ("iter_threaded", "ray-data-metadata-prefetch")


def shorten_scheduling_wait(seconds: float) -> None:
    """Ray Data's scheduling loop moves a finished block on only once every task in flight has finished or its wait
    (0.1 s) has passed; with a gate or an engine call always pending, that wait is paid at every hop between stages.
    Read by the loop at every round (streaming_executor_state.process_completed_tasks), so setting the module
    constant takes effect at once (Ray 2.60.0)."""
    from ray.data._internal.execution import streaming_executor_state

    streaming_executor_state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = seconds


def wake_on_any_task() -> None:
    """Ray Data's scheduling loop asks `ray.wait` for every task in flight at once (num_returns: all of them), so a
    finished block moves on only when the timeout (`shorten_scheduling_wait`) has passed, while a gate or an engine
    call is pending. The loop's module gets a `ray` whose `wait` returns as soon as any task that was not ready at
    its previous call is (`PromptWait`). Idempotent; covers every later stream of this process (Ray 2.60.0)."""
    from ray.data._internal.execution import streaming_executor_state

    if not isinstance(streaming_executor_state.ray, PromptWait):
        streaming_executor_state.ray = PromptWait(streaming_executor_state.ray)


class PromptWait:
    """`ray` as Ray Data's scheduling loop sees it, but for `wait`: a wait for many waits for the first of them that
    was not ready at the previous call, then takes every one ready by then. A task that stays ready (its output held
    back by Ray Data's backpressure) wakes no later call, so the loop does not spin on it: such calls wait out their
    timeout as before (as does a task ready at the previous call that has another block since: the engine's tasks
    yield one block each). Only the scheduling loop's thread calls it."""

    def __init__(self, ray_module: Any) -> None:
        self._ray = ray_module
        self._ready: set = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ray, name)

    def wait(self, refs: list, *, num_returns: int = 1, timeout: float | None = None, fetch_local: bool = True):
        fresh = [r for r in refs if r not in self._ready]
        if num_returns > 1 and fresh:
            self._ray.wait(fresh, num_returns=1, timeout=timeout, fetch_local=fetch_local)
            timeout = 0
        ready, rest = self._ray.wait(refs, num_returns=num_returns, timeout=timeout, fetch_local=fetch_local)
        self._ready = set(ready)
        return ready, rest


def fetch_metadata_in_loop() -> None:
    """Fetch a finished block's metadata inside the scheduling loop rather than on a thread of its own (one round of
    the loop later): a small object already local, about a millisecond. Read when a stream's executor starts, so it
    covers every later stream of this process (Ray 2.60.0)."""
    from ray.data._internal.execution import metadata_fetcher

    metadata_fetcher._PREFETCH_ON_THREAD = False


def repartition_in_order(ds, rows_per_block: int):
    """`ds` cut into blocks of `rows_per_block` rows by one task at a time with no CPU reserved, so the blocks keep
    their order. The public Dataset.repartition(target_num_rows_per_block=...) takes neither compute nor resources
    (Ray 2.60.0): the logical operator is built here with them."""
    import ray
    from ray.data._internal.compute import TaskPoolStrategy
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators import StreamingRepartition

    cut = StreamingRepartition(
        target_num_rows_per_block=rows_per_block,
        input_dependencies=[ds._logical_plan.dag],
        compute=TaskPoolStrategy(size=1),
        ray_remote_args={"num_cpus": 0},
    )
    return ray.data.Dataset._from_parent(ds, LogicalPlan(cut, ds.context))


def map_task_index() -> int | None:
    """The index Ray Data gave the map task this thread runs (0, 1, 2, ... in the order its operator dispatched
    them), None outside one. TaskContext is internal (Ray 2.60.0)."""
    from ray.data._internal.execution.interfaces.task_context import TaskContext

    ctx = TaskContext.get_current()
    return None if ctx is None else ctx.task_idx


def bundle_iterator(dataset) -> tuple[Iterator, Callable[[], None]]:
    """The stream's output bundles (block references, fetched by nobody yet) and a function that stops the stream's
    executor at once. The public iter_internal_ref_bundles drops the executor, which then runs on until garbage
    collected (Ray 2.60.0)."""
    bundles, _, executor = dataset._execute_to_iterator(capture_executor=False)
    return bundles, (lambda: executor.shutdown(force=True)) if executor is not None else (lambda: None)


def wait_for_data_threads(timeout_s: float = 120.0) -> None:
    """Wait until Ray Data's driver-side threads have ended, after the stream's iterator was closed.

    Closing the iterator shuts the executor down but joins its thread for only 2 s, and the iterator's own worker
    threads may still be fetching a last block. A thread that touches Ray after ray.shutdown() makes Ray's core
    worker end the whole process with exit code 1, so every one of them is joined first. The executor is a Thread
    subclass and the others are found by name (Ray 2.60.0)."""
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if isinstance(thread, StreamingExecutor) or thread.name in DATA_THREADS:
            thread.join(max(0.0, deadline - time.monotonic()))


def executor_metrics() -> dict[str, Any]:
    """The running stream's operators' metrics by operator name (benchmarks read how far an operator got): the
    executor thread's topology (Ray 2.60.0)."""
    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    executor = next(t for t in threading.enumerate() if isinstance(t, StreamingExecutor))
    return {op.name.split("[")[0]: op.metrics for op in executor._topology}


def actor_state(actor_id: str) -> dict[str, Any] | None:
    """The control store's record of an actor ("State", "NumRestarts", ...), or None if it has none. The public
    state API needs the dashboard, which a run does not start (Ray 2.60.0)."""
    from ray._private import state

    return state.actors(actor_id) or None


def no_auto_connect() -> None:
    """A Ray call in this process after the run's ray.shutdown() (a late library thread, a finaliser) would start a
    fresh local Ray by itself and could hang the exit; with auto-connect off it raises instead. Ray reads the switch
    from the environment at import, so the module's flag is set too (Ray 2.60.0)."""
    from ray._private import auto_init_hook

    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    auto_init_hook.enable_auto_connect = False


def job_env_vars() -> str:
    """The environment variable in which Ray Jobs hands its driver the job's runtime env as JSON (Ray 2.60.0)."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    return RAY_JOB_CONFIG_JSON_ENV_VAR


def keep_ray_on_loopback() -> None:
    """Ray resolves 127.0.0.1 to the host's routable address and then listens on every interface. Its
    single-machine switch keeps the node, and so every Ray server, on loopback. The switch is read when `ray` is
    imported, so it is set both for the processes Ray starts (environment) and for this one (Ray 2.60.0)."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def actor_id(handle) -> str:
    """An actor handle's id in hex, as RayActorError.actor_id gives it (no public accessor, Ray 2.60.0)."""
    return handle._actor_id.hex()


def call_on_actor(handle, fn: Callable[[Any], Any]):
    """The ObjectRef of `fn(instance)` run inside the actor: the `__ray_call__` method Ray adds to every actor class
    (ray.actor._modify_class; a developer API, Ray 2.60.0)."""
    return handle.__ray_call__.remote(fn)


def worker_node_classes() -> tuple[type, type, Callable]:
    """Ray's Node, RayParams and ensure_token_if_auth_enabled: what `ray start --block` uses to start a node
    (infra/worker_node.py starts one that stays on loopback, which `ray start` refuses to; Ray 2.60.0)."""
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    return Node, RayParams, ensure_token_if_auth_enabled


@contextlib.contextmanager
def restarts_by_keyword():
    """Ray 2.60 takes an actor stage's `max_restarts` only as a keyword of map_batches, and warns that such keywords
    are deprecated without naming a replacement for this one: silence that warning, and only it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=DEPRECATED_KEYWORDS)
        yield


DEPRECATED_KEYWORDS = "`ray_remote_args` is deprecated"  # the warning's start (ray/data/dataset.py, Ray 2.60.0)
