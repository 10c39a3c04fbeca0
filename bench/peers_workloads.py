"""bench.peers' two workloads, each as the same work for asyncrl and for TRL's GRPOTrainer.

(a) `embedded`: the embedded default job exactly (conf/default.yaml as it is): the warm-started 0.47M-parameter model,
    the 1,536 prompts in asyncrl's admission order, score_reverse, GRPO with n = 8 and 8 prompts per step, lr 5e-4,
    clip 0.2 / 0.28, token-mean, no KL, 48-token responses, 192 steps.
(b) `long`: generation-heavy (bench/peers_task.py): a ~19M-parameter random Qwen2, the same prompts, 256-token
    responses, the letters reward, bf16 compute on both sides (engine and trainer; TRL's `bf16`, its default);
    otherwise the same algorithm and batch.

Each setting of TRL's side and why is in docs/benchmarks.md ("Against TRL"); `trl_config` is the one place they are
written down in code. Both sides start from the same files: `prepare` builds them once into the bench's directory
(the embedded model warm-started through asyncrl's own cache, so asyncrl's run loads the very same weights).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from bench import peers_task
from pipeline.config import RunConfig, load_config
from stages.trainer.precision import is_bf16

WORKLOADS = ("embedded", "long")
LONG_STEPS = 40  # steps of workload (b): enough to pass a reward of 0.8 on both sides (docs/benchmarks.md)


@dataclass
class Workload:
    """One workload's inputs for both sides."""

    name: str
    model_dir: Path
    prompts_file: Path  # parquet, the embedded task's rows
    prompts_jsonl: Path  # the same rows in asyncrl's admission order, for TRL
    steps: int
    cfg: RunConfig  # the asyncrl run's config, overrides applied: trl_config reads the algorithm from it
    reward: str  # the TRL side's reward function: 'reverse' or 'letters'
    asyncrl_overrides: list[str] = field(default_factory=list)

    @property
    def samples_per_step(self) -> int:
        return self.cfg.actor.ppo_mini_batch_size * self.cfg.rollout.n


def prepare(root: Path, name: str, long_steps: int = LONG_STEPS) -> Workload:
    """Build workload `name`'s model and prompt files under root (idempotent within one root)."""
    cfg = load_config(None, [])
    embedded = root / "embedded"
    if not (embedded / "warm_started").exists():
        _build_embedded(cfg, embedded)
        (embedded / "warm_started").touch()
    train = embedded / "data" / "train.parquet"
    prompts = embedded / "prompts.jsonl"
    steps = cfg.rollout.total_rollout_steps // cfg.actor.ppo_mini_batch_size
    if name == "embedded":
        _write_order(train, cfg, steps * cfg.actor.ppo_mini_batch_size, prompts)
        return Workload(name, embedded / "model", train, prompts, steps, cfg, "reverse")
    if name != "long":
        raise SystemExit(f"unknown workload {name!r}: expected one of {WORKLOADS}")
    model = root / "long-model"
    if not (model / "config.json").exists():
        params = peers_task.build_long_model(model, embedded / "model", cfg.trainer.seed)
        print(f"bench: workload long: a {params / 1e6:.1f}M-parameter model in {model}", flush=True)
    prompts_long = root / "long-prompts.jsonl"
    _write_order(train, cfg, long_steps * cfg.actor.ppo_mini_batch_size, prompts_long)
    overrides = [
        f"model.path={model}",
        f"data.train_files={train}",
        f"data.max_response_length={peers_task.LONG_RESPONSE}",
        f"rollout.total_rollout_steps={long_steps * cfg.actor.ppo_mini_batch_size}",
        f"custom_reward_function.path={Path(peers_task.__file__).resolve()}",
        "custom_reward_function.name=compute_score",
        # bf16 matmuls run on the CPU's AMX units, several times fp32's rate at this model's widths, where the embedded
        # model's are too small to pay for autocast's casts (docs/benchmarks.md, "bf16 on the CPU").
        "rollout.dtype=bfloat16",
        "actor.fsdp_config.mixed_precision.param_dtype=bf16",
    ]
    return Workload(name, model, train, prompts_long, long_steps, load_config(None, overrides), "letters", overrides)


def _build_embedded(cfg, out: Path) -> None:
    """The embedded task as `asyncrl run` builds it, warm start included (through the same cache)."""
    from pipeline.tasks.embedded import build_embedded
    from pipeline.tasks.warmstart import cached_warm_start

    d, m = cfg.data, cfg.model
    task = build_embedded(out, d.num_embedded_prompts, cfg.trainer.seed, d.num_embedded_val_prompts)
    stats = cached_warm_start(
        task.model_dir,
        task.data_file,
        m.warm_start_steps,
        m.warm_start_lr,
        cfg.trainer.seed,
        m.warm_start_smoothing,
        m.warm_start_cache,
    )
    print(f"bench: embedded model warm-started ({stats.get('cached', 'trained now')})", flush=True)


def _write_order(train: Path, cfg, total: int, out: Path) -> None:
    """The first `total` prompts in asyncrl's admission order (pipeline/tasks/admission.py: epoch e is the rows in
    `default_rng(seed + e).permutation` order), as JSONL rows of prompt and ground_truth."""
    from pipeline.tasks.admission import AdmissionOrder

    table = pq.read_table(train).to_pylist()
    order = AdmissionOrder(len(table), total, cfg.data.seed)
    rows = np.concatenate([rows for _, rows in order.epochs()])
    lines = [json.dumps({"prompt": table[i]["prompt_text"], "ground_truth": table[i]["ground_truth"]}) for i in rows]
    out.write_text("\n".join(lines) + "\n")


def trl_config(w: Workload) -> dict:
    """GRPOConfig keywords of the TRL side, read from the asyncrl run's own config so that both run the same algorithm
    and batch (docs/benchmarks.md says why each is set). Refuses a config TRL could not match."""
    cfg = w.cfg
    a, r = cfg.actor, cfg.rollout
    if a.loss_agg_mode != "token-mean" or a.use_kl_loss or cfg.algorithm.adv_estimator != "grpo":
        raise SystemExit("bench.peers matches GRPO with token-mean and no KL loss only")
    bf16 = is_bf16(a.fsdp_config.mixed_precision.param_dtype)  # null is fp32 on a CPU, where both sides run
    if is_bf16(r.dtype) != bf16:
        raise SystemExit(
            f"rollout.dtype={r.dtype} and actor.fsdp_config.mixed_precision.param_dtype="
            f"{a.fsdp_config.mixed_precision.param_dtype} differ: TRL generates with the model it trains, in one "
            "dtype; set both to bf16 (bfloat16) or leave both unset"
        )
    samples = a.ppo_mini_batch_size * r.n
    if samples % a.micro_batch_size:
        raise SystemExit(f"actor.micro_batch_size {a.micro_batch_size} must divide a step's {samples} samples")
    return {
        "max_steps": w.steps,
        "per_device_train_batch_size": a.micro_batch_size,  # completions per forward/backward, as asyncrl's trainer
        "gradient_accumulation_steps": samples // a.micro_batch_size,  # one optimizer step per 8 prompts x 8
        "num_generations": r.n,
        "max_completion_length": cfg.data.max_response_length,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": 0,  # off, as in vLLM's sampling (transformers' own default would be 50)
        "learning_rate": a.lr,
        "lr_scheduler_type": "constant",  # TrainingArguments' default decays linearly; asyncrl's rate is constant
        "warmup_steps": 0,
        "weight_decay": a.weight_decay,
        "max_grad_norm": a.grad_clip,
        "beta": 0.0,  # no KL
        "epsilon": a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low,
        "epsilon_high": a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high,
        # Two-sided clipping: the ratio capped at delta bounds a negative-advantage token's loss at |A| * delta,
        # which is verl's dual clip with c = delta (a positive advantage is clipped at 1 + epsilon_high first).
        "delta": a.clip_ratio_c,
        "loss_type": "dapo",  # token-mean over the whole mini-batch (verl's token-mean)
        "scale_rewards": "group" if cfg.algorithm.norm_adv_by_std_in_grpo else "none",
        "num_iterations": 1,  # one pass over each batch, as asyncrl's one optimizer step per mini-batch
        "shuffle_dataset": False,  # the prompts file is already in asyncrl's order
        "gradient_checkpointing": False,  # GRPOConfig's default trades compute for memory nobody is short of here
        "bf16": bf16,  # the trainer's compute dtype (autocast over fp32 weights on both sides)
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "seed": cfg.trainer.seed,
    }
