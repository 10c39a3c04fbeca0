"""Wire the Ray Data stream from the config: source -> gate -> generate -> [reference logprobs] -> reward ->
advantage -> sample log -> split (the last four in the engine's actor unless a reference model needs its stage: see
stages/scored_generate.py); and the step-level operation the training sink applies (advantage whitening).

The source (`prompt_dataset`) reads the prompts lazily, paced by the gate's admissions: nothing of it grows with
rollout.total_rollout_steps.

Resources are set here, never inside a stage. Only this module reads stage specs from the config; the stages get
plain constructor arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext
from ray.data._internal.execution import metadata_fetcher, streaming_executor_state
from ray.exceptions import UserCodeException

from pipeline.config import ConfigError, RunConfig, check_signature, import_target, stage_kwargs
from pipeline.config.execution import reference_options
from pipeline.config.placement import SPLIT_CPUS, Placement, engine_gpus, layout, split_actors
from pipeline.config.placement import check as check_placement
from pipeline.config.placement import resolve as placement_for
from pipeline.tasks.admission import PromptSource, end_block, paced, super_chunks
from pipeline.tasks.source import PromptDataError
from stages.advantage import ESTIMATORS, whiten_step
from stages.gate import StalenessGate
from stages.handoff import SplitTokens, TokenTables
from stages.sample_log import SampleLog
from stages.scored_generate import ScoredGenerate

MiB = 1 << 20
SCHEDULING_WAIT_S = 0.02  # how long Ray Data's scheduling loop waits for its tasks (configure_data_context)


def configure_data_context(no_progress_timeout_s: float) -> None:
    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = False  # the sink orders by admission; in-order delivery would stall it
    ctx.target_max_block_size = 8 * MiB  # small blocks move as soon as they exist; groups are far smaller
    ctx.execution_no_progress_timeout_s = no_progress_timeout_s  # -1: a gate blocked through a long step is fine
    ctx.enable_progress_bars = False  # the driver shows one bar for the whole run
    ctx.print_on_execution_start = False
    # Ray Data's scheduling loop moves a finished block on only once every task in flight has finished or 0.1 s has
    # passed; with a gate or an engine call always pending, that is 0.1 s per hop between stages. 0.02 s took the
    # stream from a block's generation to the driver in 0.19 s instead of 0.45 s (bench.overhead, 8 prompts per
    # call); shorter polls spin the driver's CPU and were slower on 2 cores. tests/unit checks the name still exists.
    streaming_executor_state.WAIT_FOR_TASK_COMPLETION_TIMEOUT_S = SCHEDULING_WAIT_S
    # By default a finished block's metadata is fetched on a thread of its own and the block moves on only at the
    # loop's next round: one more wait per hop. Fetched in the loop (a small object already local: about a ms), it
    # moves on in the round that found it: the driver had a block 15 ms after its engine call returned instead of
    # 37 (tenth percentile) and the trainer idle 0.44 instead of 0.48 (the embedded job, one run each). Read when the
    # stream's executor starts, so setting it here covers every stream of this process.
    metadata_fetcher._PREFETCH_ON_THREAD = False


def _construct(spec: dict[str, Any], key: str, provided: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    """The stage class and its keywords: what the wiring provides, as far as the class takes it, plus the spec's."""
    target, extra = stage_kwargs(spec, key)
    cls = import_target(target, key)
    check_signature(cls, extra, key, provided=set(provided))
    params = inspect.signature(cls.__init__).parameters
    return cls, {**{k: v for k, v in provided.items() if k in params}, **extra}


def generate_stage(cfg: RunConfig, model_dir: str, clock: tuple[str, str], version: int) -> tuple[type, dict]:
    """The Generate stage's class and keywords. `version` labels model_dir."""
    clock_name, namespace = clock
    ro = cfg.rollout
    return _construct(
        cfg.stages.generate,
        "stages.generate",
        {
            "model_dir": model_dir,
            "initial_version": version,
            "clock_name": clock_name,
            "namespace": namespace,
            "n": ro.n,
            "max_tokens": cfg.data.max_response_length,
            "temperature": ro.temperature,
            "top_p": ro.top_p,
            "max_model_len": cfg.data.max_prompt_length + cfg.data.max_response_length,
            "kv_cache_gb": ro.kv_cache_gb,
            "tensor_parallel_size": ro.tensor_model_parallel_size,
            "seed": cfg.trainer.seed,
            "sim": dataclasses.asdict(cfg.sim),  # for the simulated engine
            "default_agent_loop": ro.agent.default_agent_loop,
            "multi_turn": dataclasses.asdict(ro.multi_turn),
            "enable_rollout_routing_replay": ro.enable_rollout_routing_replay,
            "routed_experts_capture": ro.routed_experts_capture,
            # verl: partial rollout only takes effect with staleness; otherwise in-flight requests drain at a sync
            "pause_mode": cfg.async_training.partial_rollout_mode
            if cfg.async_training.partial_rollout and cfg.async_training.staleness_threshold > 0
            else "wait",
        },
    )


def advantage_stage(cfg: RunConfig) -> tuple[type, dict]:
    """The advantage stage's class and keywords: algorithm.adv_estimator's class, unless `stages.advantage._target_`
    names one (a user's own estimator wins)."""
    alg = cfg.algorithm
    spec = {"_target_": ESTIMATORS[alg.adv_estimator], **cfg.stages.advantage}
    provided = {
        "group_size": cfg.rollout.n,
        "norm_by_std": alg.norm_adv_by_std_in_grpo,
        "gamma": alg.gamma,
        "kl_in_reward": alg.use_kl_in_reward,
        "kl_coef": alg.kl_ctrl.kl_coef,
        "kl_penalty": alg.kl_penalty,
    }
    cls, kwargs = _construct(spec, "stages.advantage", provided)
    if alg.use_kl_in_reward and "kl_in_reward" not in kwargs:
        raise ConfigError(
            f"algorithm.use_kl_in_reward needs an advantage stage that takes `kl_in_reward`; {spec['_target_']} "
            "does not: subclass stages.advantage.AdvantageStage, or set algorithm.use_kl_in_reward=false"
        )
    return cls, kwargs


def step_transform(cfg: RunConfig) -> Callable[[pa.Table], pa.Table] | None:
    """What the training sink applies to a whole step's table before it splits it: verl's batch-wide whitening for
    the estimators that ask for it (`whiten_over_step`), else nothing."""
    cls, _ = advantage_stage(cfg)
    return whiten_step if getattr(cls, "whiten_over_step", False) else None


def reference_model_dir(cfg: RunConfig, model_dir: str, run_dir: str) -> str:
    """The weights the run started from: model_dir, except on resume, where model_dir holds the checkpoint's and
    the start is model.path (or the embedded model prepare_model built into the run directory)."""
    if not cfg.resume:
        return model_dir
    return cfg.model.path if cfg.model.path != "embedded" else str(Path(run_dir) / "model")


def cluster_nodes() -> list[dict[str, float]]:
    """The resource totals of the cluster's live nodes."""
    return [node["Resources"] for node in ray.nodes() if node["Alive"]]


def placement(cfg: RunConfig) -> Placement:
    """Where this run's actors go on the cluster it is connected to (ray.placement)."""
    return placement_for(cfg.ray, cluster_nodes())


def check_layout(cfg: RunConfig) -> Placement:
    """The run's placement, once the cluster is known to be able to hold its actors: a layout it cannot hold fails
    here, at start, with one message, rather than with an actor that waits for ever."""
    nodes = cluster_nodes()
    where = placement_for(cfg.ray, nodes)
    cluster_gpus = sum(n.get("GPU", 0.0) for n in nodes)
    problem = check_placement(layout(cfg, where, cluster_gpus, cfg.uses_reference()), nodes)
    if problem:
        raise ConfigError(problem)
    return where


def start_validation_engine(cfg: RunConfig, model_dir: str, clock: tuple[str, str], version: int):
    """The dedicated validation engine (async_training.use_trainer_do_validate): one Generate actor outside the
    stream, with a CPU (and on a GPU cluster a GPU) of its own like a stream replica, on a rollout node."""
    gen_cls, gen_kwargs = generate_stage(cfg, model_dir, clock, version)
    if "enable_rollout_routing_replay" in gen_kwargs:  # nothing trains on validation samples: no routes to capture
        gen_kwargs["enable_rollout_routing_replay"] = False
    gpus = engine_gpus(cfg, ray.cluster_resources().get("GPU", 0))
    options = {"num_cpus": 1, "num_gpus": gpus, "resources": placement(cfg).rollout_resources()}
    return ray.remote(gen_cls).options(**options).remote(**gen_kwargs, validation_only=True)


@contextlib.contextmanager
def _restarts_by_keyword():
    """Ray 2.60 takes an actor stage's `max_restarts` only as a keyword of map_batches, and warns that such keywords
    are deprecated without naming a replacement for this one: silence that warning, and only it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`ray_remote_args` is deprecated")
        yield


@_restarts_by_keyword()
def build_stream(
    cfg: RunConfig,
    source: PromptSource,
    model_dir: str,
    run_dir: str,
    clock: tuple[str, str],
    tables,
    version: int = 0,
):
    """The lazy Ray Data dataset of scored samples, their per-token columns left in the object store with the
    `tables` actor (stages.handoff); iterate it with ByReference to run the stream. `version` labels model_dir."""
    clock_name, namespace = clock
    ro = cfg.rollout
    gen_cls, gen_kwargs = generate_stage(cfg, model_dir, clock, version)
    crf = cfg.custom_reward_function
    reward_cls, reward_kwargs = _construct(
        cfg.stages.reward,
        "stages.reward",
        {"custom_path": crf.path, "custom_name": crf.name, "reward_kwargs": dict(crf.reward_kwargs)},
    )
    adv_cls, adv_kwargs = advantage_stage(cfg)
    where = placement(cfg)

    ds = prompt_dataset(source, clock)
    ds = ds.map_batches(
        StalenessGate,
        fn_constructor_kwargs={"clock_name": clock_name, "namespace": namespace},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=0.1,
        resources=where.head_resources(),  # beside the clock it calls for every block
        # Not restarted: a retried call would ask the clock again for prompts it already admitted. A dead gate ends
        # the run (resume it); and Ray then has no restart to warn about (its "constructor arguments" error line).
        max_restarts=0,
        # Two calls queued at the one gate actor, which runs them one at a time and in order: the next block waits
        # at the actor instead of in the next round of Ray Data's scheduling loop (about 0.2 s per block on 2 cores).
        compute=ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=2),
    )
    engine_options = dict(
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=1,
        num_gpus=engine_gpus(cfg, ray.cluster_resources().get("GPU", 0)),
        resources=where.rollout_resources(),
        # Ray restarts a replica whose process died and retries its calls there (Ray Data's default, -1: the clock
        # enforces rollout.engine_max_restarts); 0 makes a dead replica end the run.
        max_restarts=-1 if ro.engine_max_restarts > 0 else 0,
        # Both limits: Ray Data sends calls_in_flight calls to a replica, and the replica's actor runs them at once
        # (an actor runs one call at a time unless told otherwise, even with an async __call__).
        compute=ActorPoolStrategy(
            size=ro.num_replicas,
            max_tasks_in_flight_per_actor=ro.calls_in_flight,
            max_concurrent_calls_per_actor=ro.calls_in_flight,
        ),
    )
    scoring = [reward_cls(**reward_kwargs), adv_cls(**adv_kwargs), SampleLog(f"{run_dir}/samples")]
    if cfg.scores_in_engine():  # one hop fewer: the engine's actor scores, logs and splits (stages/scored_generate.py)
        owners = TokenTables.owners(tables, where.rollout)  # of the tables, beside the engines
        generate = {"generate": (gen_cls, gen_kwargs), "scoring": scoring, "owners": owners}
        return ds.map_batches(ScoredGenerate, fn_constructor_kwargs=generate, **engine_options)
    ds = ds.map_batches(gen_cls, fn_constructor_kwargs=gen_kwargs, **engine_options)
    if cfg.uses_reference():  # the frozen model is loaded only when a KL needs it
        ref_cls, ref_kwargs = _construct(
            cfg.stages.ref_logprob,
            "stages.ref_logprob",
            {"model_dir": reference_model_dir(cfg, model_dir, run_dir), **reference_options(cfg)},
        )
        ds = ds.map_batches(
            ref_cls,
            fn_constructor_kwargs=ref_kwargs,
            batch_size=None,
            batch_format="pyarrow",
            num_cpus=0.5,  # a fraction: a stage actor holding a whole CPU can deadlock a 2-core box
            compute=ActorPoolStrategy(size=1),
        )
    # Ray Data fuses these three task stages into the split stage's actors: one call per block. An actor, not a task:
    # the per-token tables it puts in the object store live as long as the process that put them (stages/handoff.py).
    # (Fused only with equal resources: the same num_cpus on all four.)
    for stage in scoring:
        ds = ds.map_batches(stage, batch_size=None, batch_format="pyarrow", num_cpus=SPLIT_CPUS)
    return ds.map_batches(
        SplitTokens,
        fn_constructor_kwargs={"tables": tables},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=SPLIT_CPUS,
        resources=where.rollout_resources(),  # beside the engines
        compute=ActorPoolStrategy(size=split_actors(cfg)),  # fixed: see split_actors
    )


def prompt_dataset(source: PromptSource, clock: tuple[str, str] | None = None) -> ray.data.Dataset:
    """The source as Ray Data's input: blocks of `block_rows` prompts in admission order, then the end marker.

    Ray Data merges what one task yields into blocks of `target_max_block_size` bytes, so the prompts come out of
    one read task in joins of whole blocks just over that size (`super_chunks`: each leaves the task as it is
    yielded) and a streaming repartition cuts them back into blocks of `block_rows`, where `PromptSource.blocks`
    cuts them. Left alone, Ray Data would read as far ahead as its memory
    budget allows (for a large file, minutes of tokenizing and many thousand blocks); the read task is `paced` by
    the clock's admission count instead, at most two joins ahead of the gate. A second read task, read after the
    first (one at a time), gives the end marker its own block, after every prompt. The read and the cut take no
    CPU: they mostly wait, and a reserved CPU would be one fewer for the stages on a small machine.

    `clock`: the VersionClock's (name, namespace); without one (a benchmark) the read is not paced.
    """
    from ray.data._internal.compute import TaskPoolStrategy
    from ray.data._internal.logical.interfaces import LogicalPlan
    from ray.data._internal.logical.operators import StreamingRepartition

    # Over the target (whatever Ray adds to nbytes), and by less than one block: a task's output of 1.5x the target
    # or more is sliced at arbitrary rows.
    join_bytes = int(1.1 * DataContext.get_current().target_max_block_size)
    datasource = _PromptDatasource(ray.put(source), join_bytes, clock)
    ds = ray.data.read_datasource(datasource, override_num_blocks=2, num_cpus=0, concurrency=1)
    # Dataset.repartition(target_num_rows_per_block=...) takes no compute or resources: one task at a time keeps the
    # blocks in order (and the end marker last), num_cpus=0 as above.
    cut = StreamingRepartition(
        target_num_rows_per_block=source.block_rows,
        input_dependencies=[ds._logical_plan.dag],
        compute=TaskPoolStrategy(size=1),
        ray_remote_args={"num_cpus": 0},
    )
    return ray.data.Dataset._from_parent(ds, LogicalPlan(cut, ds.context))


class _PromptDatasource(ray.data.Datasource):
    """Two read tasks: the source's prompts, then its end marker. The source travels as one object in the object
    store (it holds the prompt file), not inside each task."""

    def __init__(self, source_ref: ray.ObjectRef, join_bytes: int, clock: tuple[str, str] | None) -> None:
        self.source_ref, self.join_bytes, self.clock = source_ref, join_bytes, clock

    def get_name(self) -> str:
        return "Prompts"

    def estimate_inmemory_data_size(self) -> None:
        return None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None, data_context=None) -> list:
        from ray.data.block import BlockMetadata
        from ray.data.datasource import ReadTask

        ref, join_bytes, clock = self.source_ref, self.join_bytes, self.clock

        def prompts():
            source = ray.get(ref)
            try:
                joins = super_chunks(source.chunks(), join_bytes, source.block_rows)
                yield from paced(joins, _admission_count(clock, source))
            except PromptDataError as err:
                raise BadPromptRow(err.message) from None

        unknown = BlockMetadata(num_rows=None, size_bytes=None, input_files=None, exec_stats=None)
        return [ReadTask(prompts, unknown), ReadTask(lambda: [end_block()], unknown)]


def _admission_count(clock: tuple[str, str] | None, source: PromptSource) -> Callable[[], int]:
    """Prompts of `source` the gate has admitted so far; the clock's ledger also holds a resumed run's prior ones,
    which are the ids the source skips."""
    if clock is None:
        return lambda: 1 << 62
    actor, prior = ray.get_actor(clock[0], namespace=clock[1]), len(source.order.skip)
    return lambda: ray.get(actor.stats.remote())["admitted_total"] - prior


class BadPromptRow(PromptDataError, UserCodeException):
    """A bad row the stream reached. Being a UserCodeException, Ray Data reports it as the data's fault (one line, no
    internal traceback, no advice to file a Ray bug); the driver catches it as the PromptDataError it is."""


def wait_for_executors(timeout_s: float = 120.0) -> None:
    """Wait until Ray Data's driver-side threads have ended, after the stream's iterator was closed.

    Closing the iterator shuts the executor down but joins its thread for only 2 s, and the iterator's own worker
    threads ("iter_threaded") may still be fetching a last block. A thread that touches Ray after ray.shutdown()
    makes Ray's core worker end the whole process with exit code 1, so every one of them is joined first.
    """
    import threading
    import time

    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if isinstance(thread, StreamingExecutor) or thread.name in _DATA_THREADS:
            thread.join(max(0.0, deadline - time.monotonic()))


# Ray Data threads in the driver that end once the iterator is closed and may touch Ray until they do.
_DATA_THREADS = {"iter_threaded", "ray-data-metadata-prefetch"}
