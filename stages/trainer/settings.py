"""What every trainer backend is told about the objective: the PPO loss and optimizer knobs, MoE routing replay and
verl's rollout correction. One definition, read by the config (its `actor.*` and `algorithm.rollout_correction.*`
keys are these fields) and by TorchTrainer and MegatronRank alike. Pure data: no torch, so loading a config stays cheap.

Each choice is a `Literal`, so omegaconf refuses a value outside it and names the valid ones.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Literal, get_args

from stages.trainer.lr_schedule import OptimSettings
from stages.trainer.micro_batches import MicroBatching

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
# verl's policy-loss registry (verl/trainer/ppo/core_algos.py); stages/trainer/policy_loss registers each of them
# (a test pins both). A name outside it needs actor.policy_loss.path, the user's file that registers it.
POLICY_LOSS_MODES = (
    "vanilla",
    "dppo_tv",
    "dppo_kl",
    "gspo",
    "sapo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dro",
    "cispo",
    "bypass_mode",
)
# stages/trainer/kl.py's KL_TYPES_ALL, spelt out here so loading a config does not import torch (a test pins both).
KLType = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+"
]
ISLevel = Literal["token", "sequence"]
RSOption = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
LegacyRSMode = Literal["sequence", "geometric"]
RouterReplayMode = Literal["disabled", "R2", "R3"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]


@dataclass
class RouterReplaySettings:
    """verl's `actor.router_replay.*`: MoE routing replay. With 'R3' (rollout routing replay) the trainer forces,
    at every MoE layer, the experts the engine's router chose for each context token (the `routed_experts` column),
    so that training and inference use the same experts; the router still gets gradients (its probabilities are
    gathered at the forced experts)."""

    mode: RouterReplayMode = "disabled"
    """'disabled' or 'R3'. R3 needs the engine to capture the routes and a model with MoE layers. verl's 'R2'
    (replaying routes the trainer recorded itself) is refused with a message."""
    record_file: str | None = None
    """Accepted for verl configs (verl does not read it either); must stay null."""
    replay_file: str | None = None
    """Accepted for verl configs (verl does not read it either); must stay null."""

    def __post_init__(self) -> None:
        if self.mode not in ("disabled", "R3"):  # R2 too: a verl choice, named so that its refusal can say why
            raise ValueError(
                f"actor.router_replay.mode={self.mode!r} is not supported: 'R3' replays the engine's routes (the "
                "routed_experts column), 'disabled' routes as the model does; verl's 'R2' (the trainer's own recorded "
                "routes) is not implemented"
            )
        if self.record_file is not None or self.replay_file is not None:
            raise ValueError(
                "actor.router_replay.record_file / replay_file are not supported: routes come from the engine "
                "(the routed_experts column); leave them null"
            )

    @property
    def active(self) -> bool:
        return self.mode != "disabled"


@dataclass
class PolicyLossSettings:
    """verl's `actor.policy_loss.*`: which policy loss (stages/trainer/policy_loss) and the knobs of those that have
    some, with verl's defaults."""

    loss_mode: str = "vanilla"
    """verl's registered policy losses: 'vanilla' (PPO clip with dual clip), 'dppo_tv', 'dppo_kl', 'gspo', 'sapo',
    'gpg', 'clip_cov', 'kl_cov', 'geo_mean', 'dro', 'cispo', 'bypass_mode'; or one that `path` registers."""
    path: str = ""
    """A Python file (also `file://<path>`, `pkg://<module>`) that registers more losses with
    stages.trainer.policy_loss.register_policy_loss, or defines a function named loss_mode; loaded when the config
    loads and in the trainer."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: share of the trained tokens whose gradient is cut (at least one per micro-batch)."""
    clip_cov_lb: float = 1.0
    """clip_cov: tokens with covariance in (lb, ub) are the candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: see clip_cov_lb."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: share of the trained tokens (the largest covariances) that pay ppo_kl_coef * |log ratio|."""
    ppo_kl_coef: float = 0.1
    """kl_cov: the coefficient of that penalty."""
    dro_beta: float | None = None
    """dro: the coefficient of the quadratic log-ratio penalty; required (> 0) with loss_mode=dro."""

    def __post_init__(self) -> None:
        key = "actor.policy_loss"
        if self.loss_mode not in POLICY_LOSS_MODES and not self.path:
            close = difflib.get_close_matches(self.loss_mode, POLICY_LOSS_MODES, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ValueError(
                f"{key}.loss_mode={self.loss_mode!r} is not one of verl's policy losses "
                f"({', '.join(POLICY_LOSS_MODES)}); a loss of your own needs {key}.path, the file that registers "
                f"it.{hint}"
            )
        if self.loss_mode == "dro" and (self.dro_beta is None or self.dro_beta <= 0):
            raise ValueError(f"{key}.loss_mode=dro needs {key}.dro_beta > 0 (its quadratic log-ratio penalty)")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{key}.{name} must be > 0, not {getattr(self, name)}")


@dataclass
class PolicySettings:
    """The PPO step of both backends (verl's `actor_rollout_ref.actor.*` keys, verl's defaults)."""

    lr: float = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    clip_ratio: float = 0.2
    """PPO clip range epsilon; the default of clip_ratio_low and clip_ratio_high."""
    clip_ratio_low: float | None = None
    """PPO lower clip: ratio >= 1 - clip_ratio_low; null means clip_ratio."""
    clip_ratio_high: float | None = None
    """PPO upper clip: ratio <= 1 + clip_ratio_high; null means clip_ratio (DAPO's clip-higher sets it above)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound: a token with a negative advantage loses at most |A| * clip_ratio_c. Must be > 1."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token terms become one loss, over the whole mini-batch, as verl's agg_loss: 'token-mean' (sum /
    trained tokens), 'token-sum' (the sum), 'seq-mean-token-sum' (sum of each response's token sums / responses),
    'seq-mean-token-mean' (sum of each response's token means / responses) or 'seq-mean-token-sum-norm'
    (seq-mean-token-sum / loss_scale_factor). Responses are every row of the mini-batch (ppo_mini_batch_size *
    rollout.n), fully masked ones included."""
    loss_scale_factor: int | None = None
    """The extra divisor of 'seq-mean-token-sum-norm'; null means the padded response width (the run passes
    data.max_response_length, so it is the same constant for every micro-batch)."""
    policy_loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    """Which policy loss and its knobs (verl's `actor.policy_loss`)."""
    tau_pos: float = 1.0
    """sapo: the gate's temperature on tokens with a positive advantage."""
    tau_neg: float = 1.05
    """sapo: the gate's temperature on the other tokens."""
    optim: OptimSettings = field(default_factory=OptimSettings)
    """The learning-rate schedule and AdamW's betas (verl's `actor.optim.*`; lr, weight_decay and clip_grad are
    actor.lr, actor.weight_decay and actor.grad_clip)."""
    entropy_coeff: float = 0.0
    """Entropy bonus: loss -= entropy_coeff * entropy (aggregated like the loss). actor/entropy is logged anyway."""
    use_kl_loss: bool = False
    """Add kl_loss_coef * KL(current || reference) to the loss; needs the ref_logprobs column."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    kl_loss_type: KLType = "low_var_kl"
    """Per-token KL estimator (stages/trainer/kl.py); a trailing '+' takes k2's gradient (straight-through)."""
    grad_clip: float = 1.0
    """Max global grad norm."""
    micro_batch_size: int = 32
    """Trajectories per forward/backward pass (gradient accumulation; memory only); unused with use_dynamic_bsz."""
    use_dynamic_bsz: bool = False
    """Cut each mini-batch into micro-batches by token count instead (verl's key): at most ppo_max_token_len_per_gpu
    tokens (prompt + response) each, as few as that allows, their costs balanced (stages/trainer/micro_batches.py).
    Memory only: the update is the same."""
    ppo_max_token_len_per_gpu: int = 16384
    """The token budget of a training micro-batch with use_dynamic_bsz (per rank); at least the longest prompt +
    response, since a row is never split."""
    router_replay: RouterReplaySettings = field(default_factory=RouterReplaySettings)
    """MoE routing replay (verl's `actor.router_replay`): 'R3' trains with the engine's expert choices."""
    calculate_sum_pi_squared: bool = False
    """verl's switch for the proximal pass's sum of squared token probabilities, which the optimal-token-baseline
    estimators need (as in verl, they require it on); no effect with the other estimators."""
    trainer_baseline: str = ""
    """Set from algorithm.adv_estimator, not a key of its own: 'otb' or 'tir' for verl's optimal-token-baseline pair
    (the step's proximal pass also computes sum pi^2 and the trainer subtracts the baseline from the stream's
    returns, stages/advantage/otb.py); '' when the stream's advantages are final."""

    def __post_init__(self) -> None:
        if self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"actor.clip_ratio_c must be > 1 (the dual-clip bound on |A| * ratio), not {self.clip_ratio_c}"
            )
        if self.loss_scale_factor is not None and self.loss_scale_factor <= 0:
            raise ValueError(f"actor.loss_scale_factor must be > 0 or null, not {self.loss_scale_factor}")
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError(f"actor.tau_pos and actor.tau_neg must be > 0, not {self.tau_pos} and {self.tau_neg}")
        if self.micro_batch_size < 1 or self.ppo_max_token_len_per_gpu < 1:
            raise ValueError(
                "actor.ppo_micro_batch_size_per_gpu (micro_batch_size) and actor.ppo_max_token_len_per_gpu must be "
                f">= 1, not {self.micro_batch_size} and {self.ppo_max_token_len_per_gpu}"
            )

    @property
    def batching(self) -> MicroBatching:
        """How a mini-batch is cut into forward/backward passes."""
        return MicroBatching(self.micro_batch_size, self.use_dynamic_bsz, self.ppo_max_token_len_per_gpu)

    @property
    def clip_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def clip_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


@dataclass
class ExecutionSettings:
    """How a trainer runs its model: none of it changes the update beyond float rounding, only time and memory
    (tests/unit/test_packing.py and test_micro_batches.py check it). verl's keys, gathered by the config
    (pipeline/trainer_launch.py) from `model.*`, `rollout.log_prob_*` and `actor.fsdp_config.*`."""

    use_remove_padding: bool = False
    """Pack each micro-batch's sequences into one row (stages/trainer/packing.py) instead of right-padding them."""
    enable_gradient_checkpointing: bool = False
    """Keep only each decoder layer's input for the backward and recompute the rest (torch backend)."""
    log_prob: MicroBatching | None = None
    """How the proximal recompute cuts its rows (verl's rollout.log_prob_*); None: as training does."""
    param_offload: bool = False
    """Keep the parameters (and gradients) in CPU memory between steps, on the GPU only while a step runs (torch
    backend on a GPU; nothing to move on CPU)."""
    optimizer_offload: bool = False
    """Keep the optimizer state in CPU memory except while a step runs (torch backend on a GPU)."""


@dataclass
class MegatronRecompute:
    """verl's `actor.megatron.override_transformer_config.recompute_*`: megatron-core's activation recompute, which
    keeps fewer activations for the backward and recomputes the rest (trainer.backend=megatron)."""

    recompute_granularity: RecomputeGranularity | None = None
    """'full' recomputes whole transformer layers (which: recompute_method, recompute_num_layers), 'selective' only
    the modules recompute_modules names, in every layer; null: off."""
    recompute_method: RecomputeMethod | None = None
    """With 'full': 'uniform' keeps the input of every recompute_num_layers-th layer and recomputes all layers,
    'block' recomputes the first recompute_num_layers layers of each pipeline stage and keeps the others'."""
    recompute_num_layers: int | None = None
    """With 'full': the layers per recompute unit ('uniform') or recomputed per stage ('block'); null otherwise."""
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    """With 'selective': the parts recomputed (megatron's choices: core_attn, mlp, layernorm, moe_act, moe, ...)."""

    def __post_init__(self) -> None:
        key = "actor.megatron.override_transformer_config"
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or not (self.recompute_num_layers or 0) >= 1):
            raise ValueError(
                f"{key}.recompute_granularity=full needs recompute_method ('uniform' or 'block') and "
                "recompute_num_layers >= 1"
            )
        if not full and (self.recompute_method is not None or self.recompute_num_layers is not None):
            raise ValueError(
                f"{key}.recompute_method and recompute_num_layers apply to recompute_granularity=full only, not "
                f"{self.recompute_granularity!r}: leave them null"
            )

    def transformer_config(self) -> dict:
        """The TransformerConfig keywords (none when recompute is off)."""
        if self.recompute_granularity is None:
            return {}
        out = {"recompute_granularity": self.recompute_granularity, "recompute_modules": list(self.recompute_modules)}
        if self.recompute_granularity == "full":
            out |= {"recompute_method": self.recompute_method, "recompute_num_layers": self.recompute_num_layers}
        return out


@dataclass
class CorrectionSettings:
    """verl's `algorithm.rollout_correction.*`: off-policy correction between the engine (behaviour) and the trainer
    (proximal) logprobs, with log rho = proximal - behaviour; stages/trainer/correction.py applies it.

    Rejection takes verl's named options (`RSOption`), comma-chained; a token survives only if every option keeps
    it. Two older keys still work and map onto them (verl itself dropped them):
    - `rollout_rs: sequence` keeps a response when prod_t rho in [lower, upper]: verl's `seq_sum_k1` with
      threshold "1/upper_1/lower" (k1 = -log rho flips the bounds), identical when lower = 1/upper;
    - `rollout_rs: geometric` does the same on exp(mean_t log rho): verl's `seq_mean_k1` ("Geo-RS");
    - `rollout_token_veto_threshold` rejects a response when any token's rho is below it; no verl option does
      that (`token_k1` drops only the token itself), so it is its own rule, `token_veto` in the metrics.
    """

    rollout_is: ISLevel | None = None
    """Importance weights proximal / behaviour: 'token', 'sequence' or null (off)."""
    rollout_is_threshold: float | int | str = 2.0
    """A number: the upper truncation of the weights (TIS; nothing is zeroed). 'lo_hi' (e.g. '0.5_5.0'; quote it or
    write both with a decimal point, YAML reads 0.5_5 as 0.55): IcePop, weights outside [lo, hi] become 0."""
    rollout_is_batch_normalize: bool = False
    """Divide the truncated weights by their step mean (token: over tokens; sequence: over responses)."""
    rollout_rs: str | None = None
    """Rejection: comma-chained options of RSOption (e.g. 'token_k1,seq_max_k3'), or the single legacy 'sequence'
    or 'geometric'; null is off."""
    rollout_rs_threshold: str | None = None
    """One threshold for all options or one per option, comma-separated. k1 options take 'lo_hi' (write both with a
    decimal point or quote it: YAML reads 0.5_2 as the number 0.52) or one value hi meaning lo = 1/hi; k2/k3 options
    one upper bound. A number is accepted too."""
    rollout_rs_threshold_lower: float | None = None
    """Legacy 'sequence'/'geometric' only: the lower bound of the ratio; null means 1 / rollout_rs_threshold."""
    rollout_token_veto_threshold: float | None = None
    """Reject a response when any token's ratio falls below this; null is off."""
    bypass_mode: bool | None = None
    """verl's switch between its two modes. true (bypass): the engine's logprobs are the PPO anchor and the correction
    is computed inside the loss against the current policy (verl's `bypass_mode` loss); false (decoupled): the
    trainer recomputes proximal logprobs at the start of each step and corrects against them. null: as the older
    keys say (async_training.compute_prox_log_prob, async_training.use_rollout_log_probs), by default bypass."""
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass mode's loss: 'ppo_clip' (PPO on current / engine; the IS weights are only measured) or 'reinforce'
    (-A * log pi weighted by the IS weights)."""

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        if self.rollout_is is not None and self.rollout_is not in get_args(
            ISLevel
        ):  # also when built without omegaconf
            raise ValueError(f"{key}.rollout_is must be one of {get_args(ISLevel)} or null, not {self.rollout_is!r}")
        self.is_bounds()  # raises on a bad threshold
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError(f"{key}.rollout_is_batch_normalize normalises IS weights: set {key}.rollout_is too")
        if self.rollout_token_veto_threshold is not None and self.rollout_token_veto_threshold <= 0:
            raise ValueError(f"{key}.rollout_token_veto_threshold must be > 0 or null")
        self.rs_rules()  # raises on a bad option or threshold

    @property
    def active(self) -> bool:
        return any(x is not None for x in (self.rollout_is, self.rollout_rs, self.rollout_token_veto_threshold))

    def is_bounds(self) -> tuple[float | None, float]:
        """`rollout_is_threshold` as (lo, hi): lo None for a single number (TIS), both for 'lo_hi' (IcePop)."""
        key, spec = "algorithm.rollout_correction.rollout_is_threshold", self.rollout_is_threshold
        if isinstance(spec, bool):
            raise ValueError(f"{key} is a number or 'lo_hi', not {spec!r}")
        try:
            bounds = [float(x) for x in str(spec).strip().split("_", 1)]
        except ValueError:
            raise ValueError(f"{key} is a number or 'lo_hi' (e.g. '0.5_5.0'), not {spec!r}") from None
        if min(bounds) <= 0:
            raise ValueError(f"{key} must be > 0, not {spec!r}")
        if len(bounds) == 1:
            return None, bounds[0]
        if bounds[0] > bounds[1]:
            raise ValueError(f"{key}: 'lo_hi' needs lo <= hi, not {spec!r}")
        return bounds[0], bounds[1]

    def rs_rules(self) -> list[tuple[str, float | None, float]]:
        """`rollout_rs` as (option, lo, hi) in verl's terms: k1 options keep log lo <= k1 <= log hi, k2/k3 ones
        keep stat <= hi (lo None). Empty when rejection is off."""
        key = "algorithm.rollout_correction"
        if self.rollout_rs is None:
            if self.rollout_rs_threshold_lower is not None:
                raise ValueError(f"{key}.rollout_rs_threshold_lower needs rollout_rs 'sequence' or 'geometric'")
            return []
        if self.rollout_rs_threshold is None:
            raise ValueError(f"{key}.rollout_rs needs {key}.rollout_rs_threshold (the upper bound of the ratio)")
        if self.rollout_rs.strip() in get_args(LegacyRSMode):
            return [self._legacy_rule()]
        options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))  # verl: dedup
        for opt in options or [""]:
            if opt not in get_args(RSOption):
                close = difflib.get_close_matches(opt, get_args(RSOption), n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ValueError(
                    f"{key}.rollout_rs has unknown option {opt!r}: valid are {', '.join(get_args(RSOption))}, or "
                    f"alone the legacy {' / '.join(get_args(LegacyRSMode))}.{hint}"
                )
        if self.rollout_rs_threshold_lower is not None:
            raise ValueError(
                f"{key}.rollout_rs_threshold_lower only applies to rollout_rs 'sequence'/'geometric': give k1 options "
                f"their bounds as {key}.rollout_rs_threshold='lo_hi'"
            )
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        if len(specs) not in (1, len(options)):
            raise ValueError(
                f"{key}.rollout_rs_threshold has {len(specs)} entries for {len(options)} rollout_rs options: give one "
                "shared by all or one per option, comma-separated"
            )
        return [self._rule(opt, spec) for opt, spec in zip(options, specs * len(options), strict=False)]

    def _rule(self, option: str, spec: str) -> tuple[str, float | None, float]:
        key = "algorithm.rollout_correction.rollout_rs_threshold"
        k1 = option.endswith("k1")
        if "_" in spec and not k1:
            raise ValueError(f"{key} for {option} is one upper bound, not {spec!r} ('lo_hi' is for k1 options)")
        try:
            bounds = [float(x) for x in spec.split("_", 1)]
        except ValueError:
            raise ValueError(f"{key} for {option}: {spec!r} is not a number (or 'lo_hi' for k1 options)") from None
        if min(bounds) <= 0:
            raise ValueError(f"{key} for {option} must be > 0, not {spec!r}")
        if not k1:
            return option, None, bounds[0]
        lo, hi = bounds if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
        if lo >= hi:
            raise ValueError(f"{key} for {option}: 'lo_hi' needs lo < hi, not {spec!r}")
        return option, lo, hi

    def _legacy_rule(self) -> tuple[str, float | None, float]:
        """The legacy ratio bounds [lower, upper] on rho as verl's k1 bounds on -log rho: [1/upper, 1/lower]."""
        key = "algorithm.rollout_correction"
        try:
            upper = float(self.rollout_rs_threshold)
        except ValueError:
            raise ValueError(
                f"{key}.rollout_rs_threshold for rollout_rs {self.rollout_rs!r} is one number (the upper bound of the "
                f"ratio), not {self.rollout_rs_threshold!r}"
            ) from None
        if upper <= 0:
            raise ValueError(f"{key}.rollout_rs_threshold must be > 0, not {self.rollout_rs_threshold!r}")
        lower = 1.0 / upper if self.rollout_rs_threshold_lower is None else float(self.rollout_rs_threshold_lower)
        if not 0 < lower < upper:
            raise ValueError(f"{key}: the ratio bounds need 0 < rollout_rs_threshold_lower < rollout_rs_threshold")
        option = "seq_sum_k1" if self.rollout_rs.strip() == "sequence" else "seq_mean_k1"
        return option, 1.0 / upper, 1.0 / lower


def correction_mode_error(correction: CorrectionSettings, recompute: bool, loss_mode: str) -> str | None:
    """Why rollout correction cannot run with this anchor and loss (None when it can). Decoupled mode (`recompute`:
    proximal logprobs) corrects the step before the loss; bypass mode corrects inside the bypass_mode loss, which
    verl puts in place of vanilla itself (the config loader does the same)."""
    key = "algorithm.rollout_correction"
    if recompute:
        if loss_mode == "bypass_mode":
            return (
                "actor.policy_loss.loss_mode=bypass_mode compares the current policy with the engine's logprobs, the "
                f"anchor of bypass mode, but the trainer recomputes proximal ones: set {key}.bypass_mode=true, or "
                "another loss_mode"
            )
        return None
    if (correction.active or correction.loss_type == "reinforce") and loss_mode != "bypass_mode":
        return (
            f"in bypass mode ({key}.bypass_mode=true, the default) rollout correction runs inside verl's bypass_mode "
            f"policy loss, which replaces vanilla PPO and cannot wrap actor.policy_loss.loss_mode={loss_mode}: set "
            f"{key}.bypass_mode=false (decoupled: proximal logprobs, then any loss), or loss_mode=vanilla"
        )
    return None
