"""Loading a run configuration: defaults <- YAML file <- `key=value` overrides, merged by omegaconf into the typed
schema (pipeline/config/schema.py), then the cross-field checks (pipeline/config/checks.py).

verl's spellings are accepted and translated (VERL_ALIASES: the `actor_rollout_ref.` prefixes, `actor.optim.lr`,
`actor.ppo_micro_batch_size_per_gpu`, ...), in the YAML file and on the command line alike.
Every failure is one ConfigError that names the key and its nearest valid spelling (or value).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from pipeline.config.checks import validate
from pipeline.config.reward import REWARD_ALIASES
from pipeline.config.schema import ConfigError, RunConfig
from pipeline.config.verl_keys import judge

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
DEFAULT_CONFIG = CONF_DIR / "default.yaml"
# verl's spellings of our keys, so a verl command line or YAML carries over: whole sections first, then single keys.
VERL_ALIASES = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
    "custom_reward_function": "reward.custom_reward_function",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_kwargs": "reward.reward_kwargs",
    "actor.optim.lr": "actor.lr",
    "actor.optim.weight_decay": "actor.weight_decay",
    "actor.optim.clip_grad": "actor.grad_clip",
    "actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    "actor.use_rollout_log_probs": "async_training.use_rollout_log_probs",
    "actor.optim.lr_scheduler_type": "actor.optim.lr_decay_style",
    "actor.optim.warmup_style": "actor.optim.lr_decay_style",
    "rollout.prompt_length": "data.max_prompt_length",
    "rollout.response_length": "data.max_response_length",
    "trainer.test_freq": "rollout.test_freq",
    "trainer.default_local_dir": "trainer.checkpoint_dir",
    "trainer.experiment_name": "trainer.run_name",
    "trainer.logger": "trainer.monitor",
} | REWARD_ALIASES


def _translate_verl(layer: DictConfig) -> DictConfig:
    """Move every verl-spelt key of a YAML or override layer to ours. A section merges key by key, our spelling
    winning; a single key given both ways with two values is an error."""
    for verl_key, ours in VERL_ALIASES.items():
        value = OmegaConf.select(layer, verl_key, default=None)
        if value is None:
            continue
        existing = OmegaConf.select(layer, ours, default=None)
        if isinstance(value, DictConfig) and isinstance(existing, DictConfig):  # a section: key by key, ours win
            OmegaConf.update(layer, ours, OmegaConf.merge(value, existing), merge=False, force_add=True)
        elif existing is None:
            OmegaConf.update(layer, ours, value, merge=True, force_add=True)
        elif existing != value:
            raise ConfigError(f"{verl_key}={value} and {ours}={existing} set one setting two ways: keep one")
        _drop(layer, verl_key)
    return layer


def _drop(layer: DictConfig, key: str) -> None:
    """Remove `key` from the layer, and the sections it leaves empty."""
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(layer, parent_key) if parent_key else layer
    parent.pop(leaf)
    while parent_key and not OmegaConf.select(layer, parent_key):
        parent_key, _, leaf = parent_key.rpartition(".")
        (OmegaConf.select(layer, parent_key) if parent_key else layer).pop(leaf)


def _leaves(node: DictConfig, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        out += _leaves(value, path) if isinstance(value, DictConfig) and len(value) else [path]
    return out


def _in_schema(schema: DictConfig, key: str) -> bool:
    """Whether the schema takes `key`: a field at every step, or a key inside a free-form dict field."""
    node = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig):
            return False  # below a leaf
        if OmegaConf.get_type(node) is dict:
            return True  # a dict field takes any key
        if part not in node:
            return False
        node = node._get_node(part)
    return True


def _set_aside(layer: DictConfig, schema: DictConfig) -> list[str]:
    """Take verl's keys that configure nothing here (verl_keys.RULES) out of the layer, one notice each; a key that
    asks for a capability asyncrl lacks is a ConfigError. Keys neither the schema nor the table knows stay, and the
    merge names them as unknown."""
    notices = []
    for key in _leaves(layer):
        if _in_schema(schema, key):
            continue
        value = OmegaConf.select(layer, key)
        notice, error = judge(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)
        if error:
            raise ConfigError(error)
        if notice:
            notices.append(notice)
            _drop(layer, key)
    return notices


def _nearest(key: str, node: DictConfig) -> str:
    options = [k for k in node.keys() if isinstance(k, str)] if isinstance(node, DictConfig) else []
    close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else f" Valid keys: {', '.join(sorted(options))}."


def _explain(err: Exception, schema: DictConfig) -> ConfigError:
    key = getattr(err, "full_key", None) or ""
    parts = key.split(".") if key else []
    node = schema
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, DictConfig) and part in node else None
    reason = getattr(err, "msg", str(err)).split("\n")[0]
    hint = _nearest(parts[-1], node) if parts and isinstance(node, DictConfig) else ""
    if "expected one of [" in reason:  # a value outside an enum: the nearest valid value, not a key
        valid = [v.strip("'") for v in reason.split("expected one of [", 1)[1].rstrip("].").split(", ")]
        close = difflib.get_close_matches(str(getattr(err, "value", "")), valid, n=1, cutoff=0.5)
        hint = f" Did you mean '{close[0]}'?" if close else ""
    reason = reason.split(". Did you mean")[0].split(" Did you mean")[0].rstrip(".")  # omegaconf's own guess: ours
    return ConfigError(f"config key '{key}': {reason}.{hint}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Merge defaults <- YAML file <- `key=value` overrides into a validated RunConfig."""
    schema = OmegaConf.structured(RunConfig)
    layers = [schema]
    cfg_path = Path(path) if path else DEFAULT_CONFIG
    if not cfg_path.exists():
        raise ConfigError(f"config file {cfg_path} does not exist. Pass a YAML file from {CONF_DIR}.")
    notices: list[str] = []
    layers.append(_translate_verl(OmegaConf.load(cfg_path)))
    notices += _set_aside(layers[-1], schema)
    overrides = [_dotlist_item(o) for o in overrides]
    layers.append(_translate_verl(OmegaConf.from_dotlist(overrides)))
    notices += _set_aside(layers[-1], schema)
    try:
        merged = OmegaConf.merge(*layers)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except (ConfigKeyError, ValidationError) as err:
        raise _explain(err, schema) from None
    except ValueError as err:  # a dataclass's own range check (sim.*)
        raise ConfigError(str(err)) from None

    _derive(cfg)
    validate(cfg)
    cfg.notices = notices
    return cfg


def _dotlist_item(override: str) -> str:
    """A command-line override as omegaconf's `key=value`, read as verl's hydra reads it: `+key=value` (add a key
    verl's config lacks) and `++key=value` (set it, there or not) set the key as `key=value` does, since the schema
    here holds every key it accepts (and the open sections, such as reward.reward_kwargs, take new ones). Hydra's
    other forms are one error each: `~key` deletes a key, `key@package` moves a config group, neither of which has
    a meaning here, and three or more `+` are not hydra's either."""
    key = override.split("=", 1)[0]
    name = key[2:] if key.startswith("++") else key[1:] if key.startswith("+") else key
    if "=" not in override or not name or name.startswith(("+", "~")) or override.startswith("~") or "@" in key:
        raise ConfigError(
            f"override {override!r} is not of the form key=value, +key=value or ++key=value (e.g. rollout.n=4); "
            "hydra's ~key (delete a key) and key@package have no meaning here: every key has a default."
        )
    return override[len(key) - len(name) :]


def _derive(cfg: RunConfig) -> None:
    """Sizes that verl writes relative to others (fsdp_size -1 is every trainer rank), and the anchor of the PPO
    ratio as verl's bypass_mode and the older keys say it."""
    fsdp, world = cfg.actor.fsdp_config, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if fsdp.fsdp_size == -1 and world > 0 and cfg.trainer.backend == "torch":
        fsdp.fsdp_size = world
    _derive_bypass(cfg)
    _derive_verl_run_keys(cfg)


def _derive_verl_run_keys(cfg: RunConfig) -> None:
    """verl's rollout.nnodes x n_gpus_per_node (its rollout GPUs) as engine replicas of tensor_model_parallel_size
    devices each; trainer.resume_mode=disable as resume=false (auto is decided where the checkpoints are seen:
    pipeline/checkpoint.py); val_kwargs.do_sample=false as greedy validation."""
    ro, t = cfg.rollout, cfg.trainer
    if ro.n_gpus_per_node > 0:
        devices, tp = ro.nnodes * ro.n_gpus_per_node, ro.tensor_model_parallel_size
        if devices % tp:
            raise ConfigError(
                f"rollout.nnodes x rollout.n_gpus_per_node = {devices} engine devices do not split into engines of "
                f"rollout.tensor_model_parallel_size={tp}: make it a multiple"
            )
        if ro.num_replicas not in (1, devices // tp):
            raise ConfigError(
                f"rollout.num_replicas={ro.num_replicas} and rollout.nnodes x n_gpus_per_node / tensor_model_parallel"
                f"_size = {devices // tp} both set the engines: keep one"
            )
        ro.num_replicas = devices // tp
    if t.resume_mode == "disable" and cfg.resume:
        raise ConfigError("trainer.resume_mode=disable and resume=true: keep one")
    if t.resume_mode == "resume_path":
        raise ConfigError(
            "trainer.resume_mode=resume_path resumes from a checkpoint of your choice, which is not supported: "
            "resume=true (or resume_mode=auto) continues trainer.run_name from its latest checkpoint"
        )
    if ro.val_kwargs.do_sample is False:
        ro.val_kwargs.temperature = 0.0


def _derive_bypass(cfg: RunConfig) -> None:
    """`algorithm.rollout_correction.bypass_mode` (verl's key) and the older async_training.compute_prox_log_prob /
    use_rollout_log_probs (actor.use_rollout_log_probs) say the same thing: the key that is set decides, and both
    set the other way is an error. In bypass mode with a correction to apply, verl swaps its vanilla loss for
    bypass_mode; so does this."""
    at, rc = cfg.async_training, cfg.algorithm.rollout_correction
    legacy_recompute = at.compute_prox_log_prob or not at.use_rollout_log_probs  # their defaults say bypass
    if rc.bypass_mode is None:
        rc.bypass_mode = not legacy_recompute
    elif rc.bypass_mode and legacy_recompute:
        raise ConfigError(
            "algorithm.rollout_correction.bypass_mode=true uses the engine's logprobs as the PPO anchor, but "
            "async_training.compute_prox_log_prob=true or use_rollout_log_probs=false asks for recomputed ones: "
            "keep one of them (bypass_mode is verl's current key)"
        )
    at.compute_prox_log_prob = not rc.bypass_mode
    at.use_rollout_log_probs = rc.bypass_mode
    loss = cfg.actor.policy_loss
    if rc.bypass_mode and loss.loss_mode == "vanilla" and (rc.active or rc.loss_type == "reinforce"):
        loss.loss_mode = "bypass_mode"


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
