"""Wire the Ray Data stream from the config: source -> gate -> generate -> [reference logprobs] -> [reward model] ->
[judge] -> reward -> advantage -> sample log -> split (the last four in the engine's actor unless a model needs a
stage between: see stages/scored_generate.py); and the step-level operation the training sink applies (advantage
whitening).

The source (`prompt_dataset`, pipeline/tasks/prompt_input.py) reads the prompts lazily, paced by the gate's admissions:
nothing of it grows with rollout.total_rollout_steps.

Resources are set here, never inside a stage. Only this module reads stage specs from the config; the stages get
plain constructor arguments.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray
from ray.data import ActorPoolStrategy, DataContext

from pipeline.config import ConfigError, RunConfig, bind, stage_class
from pipeline.config.execution import reference_options
from pipeline.config.placement import (
    JUDGE_CPUS,
    RM_CPUS,
    SPLIT_CPUS,
    Placement,
    engine_gpus,
    judge_gpus,
    layout,
    reference_gpus,
    reward_model_gpus,
    split_actors,
)
from pipeline.config.placement import check as check_placement
from pipeline.config.placement import resolve as placement_for
from pipeline.config.targets import advantage_wiring
from pipeline.tasks.admission import PromptSource
from pipeline.tasks.prompt_input import prompt_dataset
from stages import ray_internals
from stages.advantage import ESTIMATORS, whiten_step
from stages.gate import StalenessGate
from stages.group_filter import GroupFilter
from stages.handoff import SplitTokens, TokenTables
from stages.judge import Judge
from stages.remote_reward import RemoteReward
from stages.reward_model import RewardModel
from stages.reward_sources import RewardSources
from stages.sample_log import SampleLog
from stages.scored_generate import ScoredGenerate
from stages.sink import DynamicSampling

MiB = 1 << 20
SCHEDULING_WAIT_S = 0.02  # how long Ray Data's scheduling loop waits for its tasks (configure_data_context)


def configure_data_context(no_progress_timeout_s: float) -> None:
    ctx = DataContext.get_current()
    ctx.execution_options.preserve_order = False  # the sink orders by admission; in-order delivery would stall it
    ctx.target_max_block_size = 8 * MiB  # small blocks move as soon as they exist; groups are far smaller
    ctx.execution_no_progress_timeout_s = no_progress_timeout_s  # -1: a gate blocked through a long step is fine
    ctx.enable_progress_bars = False  # the driver shows one bar for the whole run
    ctx.print_on_execution_start = False
    # With a gate or an engine call always pending, Ray Data's scheduling loop waits its full 0.1 s at every hop
    # between stages; and by default it fetches a finished block's metadata one round later, on a thread. Both
    # shortened, and the loop wakes when any of its tasks finishes: docs/benchmarks.md has what each saved
    # (bench.overhead, the embedded job).
    ray_internals.shorten_scheduling_wait(SCHEDULING_WAIT_S)
    ray_internals.wake_on_any_task()
    ray_internals.fetch_metadata_in_loop()


def generate_stage(cfg: RunConfig, model_dir: str, clock: tuple[str, str], version: int) -> tuple[type, dict]:
    """The generate stage's class and arguments: what its kind takes from the config (SimGenerate: the simulated
    workload; VLLMGenerate, and a class put in its place: the engine's) plus the spec's own keywords, all checked
    against its constructor here (pipeline.config.bind). `version` labels model_dir."""
    from stages.sim.generate import SimGenerate

    cls, extra = stage_class(cfg.stages.generate, "stages.generate")
    clock_name, namespace = clock
    ro, at = cfg.rollout, cfg.async_training
    wiring: dict[str, Any] = {
        "clock_name": clock_name,
        "namespace": namespace,
        "n": ro.n,
        "max_tokens": cfg.data.max_response_length,
        "initial_version": version,
        # verl: partial rollout only takes effect with staleness; otherwise in-flight requests drain at a sync
        "pause_mode": at.partial_rollout_mode if at.partial_rollout and at.staleness_threshold > 0 else "wait",
    }
    if issubclass(cls, SimGenerate):
        wiring["sim"] = dataclasses.asdict(cfg.sim)
    else:
        wiring |= {
            "model_dir": model_dir,
            "temperature": ro.temperature,
            "top_p": ro.top_p,
            "max_model_len": ro.max_model_len or cfg.data.max_prompt_length + cfg.data.max_response_length,
            "top_k": ro.top_k,
            "engine_args": ro.engine_args(),
            # set here only when the config gives a share; else a preset's stages.generate keyword may
            **({"gpu_memory_utilization": share} if (share := ro.engine_gpu_share()) else {}),
            "kv_cache_gb": ro.kv_cache_gb,
            "tensor_parallel_size": ro.tensor_model_parallel_size,
            "dtype": ro.dtype,
            "seed": cfg.trainer.seed,
            "default_agent_loop": ro.agent.default_agent_loop,
            "multi_turn": dataclasses.asdict(ro.multi_turn),
            "enable_rollout_routing_replay": ro.enable_rollout_routing_replay,
            "routed_experts_capture": ro.routed_experts_capture,
        }
    return cls, bind(cls, "stages.generate", wiring, extra)


def advantage_stage(cfg: RunConfig) -> tuple[type, dict]:
    """The advantage stage's class and arguments: algorithm.adv_estimator's class, unless `stages.advantage._target_`
    names one (a user's own estimator wins). Every estimator gets the group size, and the KL settings when the
    reward pays a KL; GRPO its std switch, REINFORCE++ its discount."""
    alg = cfg.algorithm
    spec = {"_target_": ESTIMATORS[alg.adv_estimator], **cfg.stages.advantage}
    cls, extra = stage_class(spec, "stages.advantage")
    if alg.use_kl_in_reward and "kl_in_reward" not in inspect.signature(cls).parameters:
        raise ConfigError(
            f"algorithm.use_kl_in_reward needs an advantage stage that takes `kl_in_reward`; {spec['_target_']} "
            "does not: subclass stages.advantage.AdvantageStage, or set algorithm.use_kl_in_reward=false"
        )
    return cls, bind(cls, "stages.advantage", advantage_wiring(cfg, cls), extra)


def reward_stage(cfg: RunConfig) -> tuple[type, dict]:
    crf = cfg.reward.custom_reward_function
    cls, extra = stage_class(cfg.stages.reward, "stages.reward")
    wiring = {
        "custom_path": crf.path,
        "custom_name": crf.name,
        "reward_kwargs": dict(crf.reward_kwargs),
        "manager": cfg.reward_manager(),
    }
    return cls, bind(cls, "stages.reward", wiring, extra)


def step_transform(cfg: RunConfig) -> Callable[[pa.Table], pa.Table] | None:
    """What the training sink applies to a whole step's table before it splits it: verl's batch-wide whitening for
    the estimators that ask for it (`whiten_over_step`), an estimator's own `over_step` (gpg's scale), else nothing."""
    cls, _ = advantage_stage(cfg)
    return whiten_step if getattr(cls, "whiten_over_step", False) else getattr(cls, "over_step", None)


def dynamic_sampling(cfg: RunConfig, clock, path: str, start_step: int) -> DynamicSampling | None:
    """The sink's dynamic sampling when algorithm.filter_groups.enable (its filter and its cap, max_num_gen_batches
    steps' worth of groups) and its refill of the groups reward.on_error=drop_group drops; the clock's refund of a
    left-out prompt's permit. None when neither is on."""
    fg, drop = cfg.algorithm.filter_groups, cfg.reward.on_error == "drop_group"
    if not (fg.enable or drop):
        return None
    cap = fg.max_num_gen_batches * cfg.async_training.require_batches * cfg.actor.ppo_mini_batch_size

    def drained(buffered: int) -> bool:
        stats = ray.get(clock.stats.remote())
        return stats["source_done"] and stats["outstanding"] == buffered

    def on_filtered(prompt_ids: list[str]) -> int:
        return ray.get(clock.filtered.remote(prompt_ids))

    group_filter = GroupFilter(fg.metric) if fg.enable else None
    return DynamicSampling(group_filter, on_filtered, path, cap if fg.enable else 0, start_step, drained, drop)


def reward_step(cfg: RunConfig) -> RewardSources:
    """The reward step: the rule stage (`stages.reward`, with the custom reward function) unless a model source alone
    gives the reward, the remote service when reward.remote.url is set, and the failure policy
    (stages/reward_sources.py)."""
    crf, rw = cfg.reward.custom_reward_function, cfg.reward
    remote = RemoteReward(**dataclasses.asdict(rw.remote)) if rw.remote.url else None
    rule = None
    model_sources = tuple(
        name for name, on in (("reward_model", rw.reward_model.enable), ("judge", rw.judge.enable)) if on
    )
    if crf.path or not (model_sources or remote):
        reward_cls, reward_kwargs = reward_stage(cfg)
        rule = reward_cls(**reward_kwargs)
    return RewardSources(
        rule,
        rule_name="custom" if crf.path else "rule",
        remote=remote,
        model_sources=model_sources,
        on_error=rw.on_error,
        max_attempts=rw.max_attempts,
        backoff_s=rw.retry_backoff_s,
    )


def reward_model_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The reward-model stage's keywords (reward.reward_model); it retries a failed forward pass only under
    reward.on_error=retry."""
    rm, rw = cfg.reward.reward_model, cfg.reward
    return {
        "model_path": rm.model_path,
        "micro_batch_size": rm.micro_batch_size_per_gpu,
        "max_length": rm.max_length,
        "dtype": rm.dtype,
        "max_attempts": rw.max_attempts if rw.on_error == "retry" else 1,
    }


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


@dataclass(frozen=True)
class Stage:
    """One stage of the stream: what Ray Data runs, with which constructor arguments, and how (map_batches
    keywords). `fn` is a class, built once in each of its actors with `kwargs`, or a callable run as a task, which Ray
    Data fuses into the actor stage after it when their resources are equal."""

    name: str
    fn: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def apply(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        actor = isinstance(self.fn, type)
        constructor = {"fn_constructor_kwargs": self.kwargs} if actor else {}
        return ds.map_batches(self.fn, batch_size=None, batch_format="pyarrow", **constructor, **self.options)


@dataclass(frozen=True)
class StreamInputs:
    """What the stages are built from besides the config."""

    model_dir: str
    run_dir: str
    clock: tuple[str, str]  # the VersionClock's (name, namespace)
    tables: Any  # the TokenTables actor the per-token columns go to (stages/handoff.py)
    version: int = 0  # the weight version of model_dir
    where: Placement = Placement()  # where the actors go (ray.placement)
    cluster_gpus: float = 0.0
    owners: dict[str, Any] | None = None  # TokenTables.owners, when the engines score (stages/scored_generate.py)


def stream_stages(cfg: RunConfig, inputs: StreamInputs) -> list[Stage]:
    """The stream's stages in order, from the config: gate, generate, [reference logprobs], [reward model], reward,
    advantage, sample log, split. Scoring runs in the engine's actor (the last four inside ScoredGenerate) unless a
    model (the reference, a reward model) needs a stage between generation and scoring (RunConfig.scores_in_engine)."""
    gen_cls, gen_kwargs = generate_stage(cfg, inputs.model_dir, inputs.clock, inputs.version)
    adv_cls, adv_kwargs = advantage_stage(cfg)
    scoring = [reward_step(cfg), adv_cls(**adv_kwargs), SampleLog(f"{inputs.run_dir}/samples")]
    engine = _engine_options(cfg, inputs)
    if cfg.scores_in_engine():  # one hop fewer: the engine's actor scores, logs and splits
        generate = {"generate": (gen_cls, gen_kwargs), "scoring": scoring, "owners": inputs.owners}
        return [_gate(inputs), Stage("generate", ScoredGenerate, generate, engine)]
    stages = [_gate(inputs), Stage("generate", gen_cls, gen_kwargs, engine), *_model_stages(cfg, inputs)]
    # Task stages, fused by Ray Data into the split stage's actors (equal resources): one call per block. The split
    # stage is an actor, not a task: the per-token tables it puts in the object store live as long as the process
    # that put them (stages/handoff.py).
    stages += [Stage(type(s).__name__, s, options={"num_cpus": SPLIT_CPUS}) for s in scoring]
    split = {
        "num_cpus": SPLIT_CPUS,
        "resources": inputs.where.rollout_resources(),  # beside the engines
        "compute": ActorPoolStrategy(size=split_actors(cfg)),  # fixed: see split_actors
    }
    return [*stages, Stage("split", SplitTokens, {"tables": inputs.tables}, split)]


def _model_stages(cfg: RunConfig, inputs: StreamInputs) -> list[Stage]:
    """The model stages between generation and scoring, each in actors of its own: the reference model's logprobs
    when a KL needs them, the reward model's scores when reward.reward_model.enable. A fraction of a CPU each: a stage
    actor holding a whole CPU can deadlock a small machine; a GPU each where the cluster has them."""
    stages = []
    if cfg.uses_reference():  # the frozen model is loaded only when a KL needs it
        ref_cls, ref_extra = stage_class(cfg.stages.ref_logprob, "stages.ref_logprob")
        ref_wiring = {"model_dir": reference_model_dir(cfg, inputs.model_dir, inputs.run_dir), **reference_options(cfg)}
        ref_kwargs = bind(ref_cls, "stages.ref_logprob", ref_wiring, ref_extra)
        ref_options = {
            "num_cpus": 0.5,
            "num_gpus": reference_gpus(cfg, inputs.cluster_gpus),  # it computes on a GPU it is given
            "compute": ActorPoolStrategy(size=1),
        }
        stages.append(Stage("ref_logprob", ref_cls, ref_kwargs, ref_options))
    rm = cfg.reward.reward_model
    if rm.enable:
        rm_options = {
            "num_cpus": RM_CPUS,
            "num_gpus": reward_model_gpus(cfg, inputs.cluster_gpus),
            "compute": ActorPoolStrategy(size=rm.num_replicas),
        }
        stages.append(Stage("reward_model", RewardModel, reward_model_kwargs(cfg), rm_options))
    judge = cfg.reward.judge
    if judge.enable:
        judge_options = {
            "num_cpus": JUDGE_CPUS,
            "num_gpus": judge_gpus(cfg, inputs.cluster_gpus),
            "compute": ActorPoolStrategy(size=judge.num_replicas),
        }
        stages.append(Stage("judge", Judge, judge_kwargs(cfg, inputs.model_dir), judge_options))
    return stages


def judge_kwargs(cfg: RunConfig, model_dir: str) -> dict[str, Any]:
    """The judge stage's keywords (reward.judge): the policy's starting weights unless a model is named; it judges
    a failed sample again only under reward.on_error=retry."""
    judge, rw = cfg.reward.judge, cfg.reward
    return {
        "model_dir": judge.model_path or model_dir,
        "path": judge.path,
        "max_tokens": judge.max_tokens,
        "temperature": judge.temperature,
        "max_model_len": judge.max_model_len,
        "kv_cache_gb": judge.kv_cache_gb,
        "seed": cfg.trainer.seed,
        "max_attempts": rw.max_attempts if rw.on_error == "retry" else 1,
    }


def _gate(inputs: StreamInputs) -> Stage:
    clock_name, namespace = inputs.clock
    options = {
        "num_cpus": 0.1,
        "resources": inputs.where.head_resources(),  # beside the clock it calls for every block
        # Not restarted: a retried call would ask the clock again for prompts it already admitted. A dead gate ends
        # the run (resume it); and Ray then has no restart to warn about.
        "max_restarts": 0,
        # Two calls at the one gate actor, which admits them one at a time and in order (stages/gate.py, Turns):
        # the next block waits at the actor instead of in the next round of Ray Data's scheduling loop, and the end
        # marker's call, which waits for the trainer, takes one thread of the two, never the only one.
        "compute": ActorPoolStrategy(size=1, max_tasks_in_flight_per_actor=2),
        "max_concurrency": 2,
    }
    return Stage("gate", StalenessGate, {"clock_name": clock_name, "namespace": namespace}, options)


def _engine_options(cfg: RunConfig, inputs: StreamInputs) -> dict[str, Any]:
    ro = cfg.rollout
    return {
        "num_cpus": 1,
        "num_gpus": engine_gpus(cfg, inputs.cluster_gpus),
        "resources": inputs.where.rollout_resources(),
        # Ray restarts a replica whose process died and retries its calls there (Ray Data's default, -1: the clock
        # enforces rollout.engine_max_restarts); 0 makes a dead replica end the run.
        "max_restarts": -1 if ro.engine_max_restarts > 0 else 0,
        # Both limits: Ray Data sends calls_in_flight calls to a replica, and the replica's actor runs them at once
        # (an actor runs one call at a time unless told otherwise, even with an async __call__).
        "compute": ActorPoolStrategy(
            size=ro.num_replicas,
            max_tasks_in_flight_per_actor=ro.calls_in_flight,
            max_concurrent_calls_per_actor=ro.calls_in_flight,
        ),
    }


@ray_internals.restarts_by_keyword()
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
    where = placement(cfg)
    owners = TokenTables.owners(tables, where.rollout) if cfg.scores_in_engine() else None  # beside the engines
    gpus = ray.cluster_resources().get("GPU", 0)
    inputs = StreamInputs(model_dir, run_dir, clock, tables, version, where, gpus, owners)
    ds = prompt_dataset(source, clock)
    for stage in stream_stages(cfg, inputs):
        ds = stage.apply(ds)
    return ds
