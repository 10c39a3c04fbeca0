"""Everything a run needs before the stream starts: run directory, model, prompts, Ray, the control actors.

Input errors (missing model or data, malformed rows) surface here, before the stream starts, as one clear message:
a missing path before Ray starts, the rest while it starts (the model built and checked, the prompts read with its
tokenizer), and a Ray started for the run stops again when they fail. For the training prompts that is every check
that takes seconds whatever the file's size (pipeline/tasks/source.py); the rest of each row is checked when the
stream reads it, and a bad one there fails the run with the same message.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from pipeline import checkpoint
from pipeline.checkpoint import Checkpoint
from pipeline.clock import VersionClock
from pipeline.config import ConfigError, RunConfig, to_yaml
from pipeline.config.checks import check_engine_heads
from pipeline.config.placement import Placement
from pipeline.config.reward import check_reward_sources
from pipeline.observe.monitor import Monitor, make_monitor
from pipeline.stream import check_layout
from pipeline.tasks.admission import AdmissionOrder, PromptSource
from pipeline.tasks.model_overrides import apply_overrides
from pipeline.tasks.source import PromptDataError, PromptFile, PromptOptions, check_prompt_file, load_prompts
from stages import ray_internals
from stages.staleness import StalenessBudget

CLOCK_NAME = "version_clock"  # the VersionClock's actor name, in the run's own namespace


@dataclass(frozen=True)
class RunContext:
    """What `prepare` established before anything of the stream starts; frozen, complete when it returns."""

    cfg: RunConfig
    run_dir: Path
    model_dir: Path
    source: PromptSource  # the stream's prompts, laid out lazily (pipeline/tasks/admission.py)
    namespace: str
    monitor: Monitor
    placement: Placement  # where the actors go (ray.placement), checked against the cluster
    started_ray: bool = False  # this run started the local Ray it uses (and ends it)
    resumed: Checkpoint | None = None  # the checkpoint this attempt continues from
    optimizer_state: Path | None = None
    val_prompts: pa.Table | None = None  # held-out prompts (pipeline/validate.py)

    @property
    def start_step(self) -> int:
        return self.resumed.step if self.resumed else 0

    @property
    def start_version(self) -> int:
        return self.resumed.version if self.resumed else 0

    @property
    def checkpoint_root(self) -> str:
        return checkpoint.root_of(self.cfg.trainer.checkpoint_dir, self.run_dir)

    @property
    def clock_handle(self) -> tuple[str, str]:
        """The VersionClock's (name, namespace), by which stages find it (stages.control.ClockLink)."""
        return CLOCK_NAME, self.namespace

    def prior_admissions(self) -> list[tuple[str, int, float]]:
        if self.resumed is None:
            return []
        ledger = self.resumed.ledger
        return list(zip(*(ledger[c].to_pylist() for c in ledger.column_names), strict=True))


@dataclass
class Attempt:
    """What one attempt of the run started as it goes, to be ended with it (`shutdown`): on a cluster that outlives
    the run, a restarted attempt reuses the actors' names."""

    ctx: RunContext
    clock: Any = None
    trainer: Any = None
    trainer_group: Any = None  # the placement group of a trainer over several nodes (pipeline/trainer_launch.py)
    stream: Any = None  # the stream's consumer (stages.sink.TrainingSink), closed before Ray stops

    def start_clock(self, budget: StalenessBudget):
        ctx = self.ctx
        name, namespace = ctx.clock_handle
        self.clock = (
            ray.remote(VersionClock)
            .options(
                name=name,
                namespace=namespace,
                num_cpus=0,
                max_concurrency=1000,
                resources=ctx.placement.head_resources(),  # beside the driver and the gate that call it
            )
            .remote(
                budget,
                ctx.cfg.rollout.num_replicas,
                ctx.start_version,
                ctx.prior_admissions(),
                ctx.cfg.rollout.engine_max_restarts,
            )
        )
        return self.clock

    def stop_ray(self) -> None:
        if self.ctx.started_ray and ray.is_initialized():
            ray.shutdown()
        elif ray.is_initialized():  # a cluster that goes on: end what this attempt started (a restart reuses names)
            for actor in (self.trainer, self.clock):
                if actor is not None:
                    ray.kill(actor)
            if self.trainer_group is not None:
                ray.util.remove_placement_group(self.trainer_group)

    def shutdown(self) -> None:
        """Stop the stream, then Ray; a monitor still open here means the run did not reach its summary: mark it
        failed. The stream goes first: Ray Data's iterator, closed after ray.shutdown() (by the garbage collector),
        calls into Ray from the driver's threads, which ends the process or hangs it."""
        try:
            if self.stream is not None and ray.is_initialized():
                self.stream.close()
                ray_internals.wait_for_data_threads(timeout_s=20.0)
            self.stop_ray()
        finally:
            self.ctx.monitor.close("FAILED")


# What a run that trained leaves in its directory; a directory with only config.yaml, model/ or data/ is one whose
# run failed its checks, and starting again there is fine.
RUN_RECORDS = ("metrics.jsonl", "samples", "consumed", "admitted.parquet")


def make_run_dir(cfg: RunConfig) -> Path:
    name = cfg.trainer.run_name or time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.output_dir).resolve() / name
    held = [record for record in RUN_RECORDS if (run_dir / record).exists()]
    if held and not cfg.resume:  # its logs would take this run's records beside their own and fail its audit
        raise ConfigError(
            f"trainer.run_name={name}: {run_dir} already holds a run ({', '.join(held)}). Continue it with "
            "resume=true, choose another trainer.run_name (empty: a timestamped one), or remove that directory"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    return run_dir


def check_paths(cfg: RunConfig) -> None:
    """The model directory and the prompt file the config names exist: in milliseconds, before Ray starts."""
    if cfg.model.path != "embedded" and not (Path(cfg.model.path) / "config.json").exists():
        raise FileNotFoundError(
            f"model.path {cfg.model.path} has no config.json: point it at an HF model directory "
            f"or use model.path=embedded"
        )
    if cfg.data.train_files == "embedded":
        if cfg.model.path != "embedded":
            raise PromptDataError(
                "data.train_files=embedded needs model.path=embedded (its tokenizer is built "
                "with the task); set data.train_files to your prompt file"
            )
    else:
        check_prompt_file(cfg.data.train_files)


def prepare_model(cfg: RunConfig, run_dir: Path) -> tuple[Path, str]:
    """The model directory and the prompt file (`check_paths` first); builds the embedded ones (a random model and
    its tokenizer, in seconds) when asked. Their warm start is `warm_start_embedded`, once every input has been
    checked."""
    if cfg.model.path != "embedded":
        return Path(cfg.model.path), cfg.data.train_files
    from pipeline.tasks.embedded import build_embedded

    d = cfg.data
    task = build_embedded(
        run_dir, d.num_embedded_prompts, cfg.trainer.seed, d.num_embedded_val_prompts, d.embedded_task, cfg.model.arch
    )
    data = str(task.data_file) if cfg.data.train_files == "embedded" else cfg.data.train_files
    return task.model_dir, data


def warm_start_embedded(cfg: RunConfig, model_dir: Path, run_dir: Path) -> None:
    """The embedded model's supervised warm start (tens of seconds) on its task's training rows, in place."""
    if cfg.model.path != "embedded" or cfg.model.warm_start_steps <= 0:
        return
    from pipeline.tasks.warmstart import cached_warm_start

    m, task_rows = cfg.model, run_dir / "data" / "train.parquet"  # written by build_embedded
    stats = cached_warm_start(
        model_dir,
        task_rows,
        m.warm_start_steps,
        m.warm_start_lr,
        cfg.trainer.seed,
        m.warm_start_smoothing,
        m.warm_start_cache,
    )
    if "cached" in stats:
        print(f"asyncrl: warm start {m.warm_start_steps} steps, loaded from {stats['cached']}", flush=True)
    else:
        print(f"asyncrl: warm start {m.warm_start_steps} steps, {stats}", flush=True)


def load_val_prompts(cfg: RunConfig, run_dir: Path, tokenizer) -> pa.Table | None:
    """The held-out prompts with ids 'val-<row>', or None without data.val_files."""
    if not cfg.data.val_files:
        return None
    if cfg.data.val_files == "embedded":
        if cfg.model.path != "embedded":
            raise PromptDataError("data.val_files=embedded needs model.path=embedded; set it to a held-out file")
        path = str(run_dir / "data" / "val.parquet")
    else:
        path = cfg.data.val_files
    table = load_prompts(path, tokenizer, cfg.data.max_prompt_length, options=prompt_options(cfg))
    ids = pa.array([f"val-{r:06d}" for r in table.column("row").to_pylist()], pa.string())
    return table.drop_columns(["row"]).add_column(0, "prompt_id", ids)


def prompt_source(cfg: RunConfig, data_file: str, tokenizer, resumed: Checkpoint | None) -> PromptSource:
    """The training prompts, checked up front as far as seconds allow (pipeline/tasks/source.py), in an admission
    order laid out as the stream reads it; a resumed run's order leaves out what its checkpoint's ledger admitted."""
    d = cfg.data
    prompts = PromptFile(
        data_file, tokenizer, d.max_prompt_length, cfg.rollout.agent.default_agent_loop, prompt_options(cfg)
    )
    if prompts.filtered:
        print(f"asyncrl: data.filter_overlong_prompts dropped {prompts.filtered} prompts of {data_file}", flush=True)
    skip = frozenset(resumed.ledger["prompt_id"].to_pylist()) if resumed else frozenset()
    order = AdmissionOrder(prompts.num_rows, cfg.rollout.total_rollout_steps, d.seed, skip, d.shuffle)
    return PromptSource(prompts.check_up_front(), order, cfg.rollout.prompts_per_call)


def prompt_options(cfg: RunConfig) -> PromptOptions:
    d = cfg.data
    return PromptOptions(d.prompt_key, d.truncation, d.filter_overlong_prompts, dict(d.apply_chat_template_kwargs))


def check_context(cfg: RunConfig, model_dir: Path) -> None:
    """Prompt plus response must fit the model's positions (the embedded model has 256).

    vLLM refuses a longer max_model_len, but from inside the Generate actor, after Ray started; this says it once,
    with the keys to change. A RoPE scaling factor changes the limit by rules vLLM owns, so then vLLM decides. The
    engine's tensor parallelism must split the model's heads (check_engine_heads), said here too."""
    config = json.loads((model_dir / "config.json").read_text())
    check_engine_heads(cfg.rollout.tensor_model_parallel_size, config, str(model_dir))
    positions = config.get("max_position_embeddings")
    scaled = "factor" in json.dumps(config.get("rope_scaling") or config.get("rope_parameters") or {})
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if isinstance(positions, int) and not scaled and need > positions:
        raise ConfigError(
            f"data.max_prompt_length ({cfg.data.max_prompt_length}) + data.max_response_length "
            f"({cfg.data.max_response_length}) = {need} tokens, more than the model's {positions} positions "
            f"(max_position_embeddings in {model_dir / 'config.json'}). Lower one of the two."
        )


def check_moe(model_dir: Path) -> None:
    """Routing replay needs a model with routers: said here, not by the engine inside its actor."""
    config = json.loads((model_dir / "config.json").read_text())
    experts = max(int(config.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if experts <= 0:
        raise ConfigError(
            f"rollout.enable_rollout_routing_replay needs a mixture-of-experts model; {model_dir / 'config.json'} "
            "declares no experts (num_experts). Set rollout.enable_rollout_routing_replay=false."
        )


def check_megatron(cfg: RunConfig, model_dir: Path) -> None:
    """The model must be one megatron_convert knows, TP must split its heads and PP its layers: said here, before
    Ray starts."""
    from stages.trainer.megatron_convert import ModelShape

    try:
        shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
        shape.check_tp(cfg.actor.megatron.tensor_model_parallel_size)
        shape.check_pp(cfg.actor.megatron.pipeline_model_parallel_size)
    except ValueError as err:
        raise ConfigError(f"{err} (model: {model_dir})") from None


def start_ray(cfg: RunConfig, run_dir: Path) -> bool:
    """Connect to the configured cluster or start a local one on loopback; returns whether we started it."""
    if ray.is_initialized():
        return False
    # Workers import stages/ and pipeline/ from the checkout; the engine's worker process does too. In a Ray job
    # the job's working_dir goes ahead of this PYTHONPATH on every worker, so both name the same code.
    env_vars = {
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    _no_usage_reporting()
    # A driver started by Ray Jobs finds its cluster's GCS address in RAY_ADDRESS: it joins that cluster rather
    # than starting a second Ray beside it (which would also fail on the num_cpus below).
    address = cfg.ray.address or os.environ.get("RAY_ADDRESS", "")
    if address:
        if _on_loopback(address):  # else Ray looks for this machine's nodes at its routable address, and waits
            ray_internals.keep_ray_on_loopback()
        ray.init(address=address, runtime_env={"env_vars": _not_set_by_job(env_vars)}, log_to_driver=False)
        ray_internals.no_auto_connect()
        return False
    ray_internals.keep_ray_on_loopback()
    ray.init(
        address="local",  # a new local instance: never join a `ray start` cluster found on this machine
        num_cpus=cfg.ray.num_cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": env_vars},
        log_to_driver=os.environ.get("ASYNCRL_WORKER_LOGS") == "1",
        _temp_dir=os.environ.get("ASYNCRL_RAY_TMP"),
    )
    ray_internals.no_auto_connect()
    return True


def _not_set_by_job(env_vars: dict[str, str]) -> dict[str, str]:
    """Inside a Ray job, ray.init merges its runtime env with the job's and refuses a variable that both set: the
    submitter's value wins, ours is left out. Ray passes the job's runtime env to its driver in this variable."""
    job_config = json.loads(os.environ.get(ray_internals.job_env_vars()) or "{}")
    taken = (job_config.get("runtime_env") or {}).get("env_vars") or {}
    return {k: v for k, v in env_vars.items() if k not in taken}


def _no_usage_reporting() -> None:
    """Ray's usage stats would send a report off this machine, and Ray Data's usage collection leaves a poller
    thread in the driver that keeps querying the cluster after ray.shutdown(). Both are read at call time."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["RAY_DATA_USAGE_DISABLED"] = "1"


def _on_loopback(address: str) -> bool:
    """Whether a cluster address (`host:port`, `ray://host:port`) names this machine's loopback."""
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def prepare(cfg: RunConfig) -> RunContext:
    checkpoint.resolve_auto_resume(cfg)  # trainer.resume_mode=auto
    run_dir = make_run_dir(cfg)
    # Rewind before the monitor appends to metrics.jsonl; the monitor next: a bad tracking store fails in seconds.
    resumed = _rewind(cfg, run_dir) if cfg.resume else None
    monitor = make_monitor(cfg, run_dir)
    started = False
    try:
        if resumed:
            (model_dir, optimizer_state), data_file = checkpoint.fetch(resumed, run_dir), _resumed_data(cfg, run_dir)
        else:
            check_paths(cfg)  # the common mistakes, said before Ray starts
            model_dir, optimizer_state, data_file = None, None, ""
        # The model's build and checks and the prompts' (transformers' import: seconds) run beside Ray's start, which
        # mostly waits on its daemons. Ray starts in the main thread: its daemons die with the thread that started them.
        with ThreadPoolExecutor(1, thread_name_prefix="asyncrl-inputs") as pool:
            inputs = pool.submit(checked_inputs, cfg, run_dir, resumed, model_dir, data_file)
            started = start_ray(cfg, run_dir)
            model_dir, source, val_prompts = inputs.result()
        if not resumed:  # only now: every input above is checked before the tens of seconds it takes
            warm_start_embedded(cfg, model_dir, run_dir)
        where = _checked_layout(cfg, started)
    except BaseException:
        if started and ray.is_initialized():  # a bad input found beside Ray's start: the Ray it started stops
            ray.shutdown()
        monitor.close("FAILED")
        raise
    namespace = f"asyncrl-{run_dir.name}"
    return RunContext(
        cfg, run_dir, model_dir, source, namespace, monitor, where, started, resumed, optimizer_state, val_prompts
    )


def checked_inputs(
    cfg: RunConfig, run_dir: Path, resumed: Checkpoint | None, model_dir: Path | None, data_file: str
) -> tuple[Path, PromptSource, pa.Table | None]:
    """The model (a resumed run's `model_dir`, else built or found, its overrides applied), checked against the
    config, and the training and held-out prompts read with its tokenizer."""
    if not resumed:
        model_dir, data_file = prepare_model(cfg, run_dir)
        embedded = cfg.model.path == "embedded"  # built in the run directory: overridden in place
        model_dir = apply_overrides(model_dir, dict(cfg.model.override_config), run_dir, in_place=embedded)
    if cfg.stages.generate["_target_"] == "stages.generate.VLLMGenerate":
        check_context(cfg, model_dir)
    if cfg.rollout.enable_rollout_routing_replay:
        check_moe(model_dir)
    if cfg.trainer.backend == "megatron":
        check_megatron(cfg, model_dir)
    check_reward_sources(cfg.reward)  # a reward model's directory, a remote service that answers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model_dir, prompt_source(cfg, data_file, tokenizer, resumed), load_val_prompts(cfg, run_dir, tokenizer)


def _checked_layout(cfg: RunConfig, started_ray: bool) -> Placement:
    """Where the actors go, once the cluster can hold them; a Ray this run started does not outlive a refusal."""
    try:
        return check_layout(cfg)
    except ConfigError:
        if started_ray:
            ray.shutdown()
        raise


def _rewind(cfg: RunConfig, run_dir: Path) -> Checkpoint:
    """The latest checkpoint; the run dir is rewound to it (what came after moves to discarded/)."""
    ckpt = checkpoint.latest(checkpoint.root_of(cfg.trainer.checkpoint_dir, run_dir))
    moved = checkpoint.rewind(run_dir, ckpt)
    print(f"asyncrl: resuming at step {ckpt.step} (version {ckpt.version}) from {ckpt.url}; discarded {moved}")
    return ckpt


def _resumed_data(cfg: RunConfig, run_dir: Path) -> str:
    return str(run_dir / "data" / "train.parquet") if cfg.data.train_files == "embedded" else cfg.data.train_files
