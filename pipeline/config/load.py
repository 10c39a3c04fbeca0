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
from pipeline.config.schema import ConfigError, RunConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
DEFAULT_CONFIG = CONF_DIR / "default.yaml"
# verl's spellings of our keys, so a verl command line or YAML carries over: whole sections first, then single keys.
VERL_ALIASES = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
    "actor.optim.lr": "actor.lr",
    "actor.optim.weight_decay": "actor.weight_decay",
    "actor.optim.clip_grad": "actor.grad_clip",
    "actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
}


def _translate_verl(layer: DictConfig) -> DictConfig:
    """Move every verl-spelt key of a YAML or override layer to ours; our own spelling wins over an alias."""
    for verl_key, ours in VERL_ALIASES.items():
        value = OmegaConf.select(layer, verl_key, default=None)
        if value is None:
            continue
        existing = OmegaConf.select(layer, ours, default=None)
        if isinstance(value, DictConfig) and isinstance(existing, DictConfig):  # a section: key by key, ours win
            OmegaConf.update(layer, ours, OmegaConf.merge(value, existing), merge=False, force_add=True)
        elif existing is None:
            OmegaConf.update(layer, ours, value, merge=True, force_add=True)
        parent_key, _, leaf = verl_key.rpartition(".")
        parent = OmegaConf.select(layer, parent_key) if parent_key else layer
        parent.pop(leaf)
        while parent_key and not OmegaConf.select(layer, parent_key):  # drop the emptied verl sections
            parent_key, _, leaf = parent_key.rpartition(".")
            (OmegaConf.select(layer, parent_key) if parent_key else layer).pop(leaf)
    return layer


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
    layers.append(_translate_verl(OmegaConf.load(cfg_path)))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. rollout.n=4).")
    layers.append(_translate_verl(OmegaConf.from_dotlist(list(overrides))))
    try:
        merged = OmegaConf.merge(*layers)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except (ConfigKeyError, ValidationError) as err:
        raise _explain(err, schema) from None
    except ValueError as err:  # a dataclass's own range check (sim.*)
        raise ConfigError(str(err)) from None

    _derive(cfg)
    validate(cfg)
    return cfg


def _derive(cfg: RunConfig) -> None:
    """Sizes that verl writes relative to others: fsdp_size -1 is every trainer rank."""
    fsdp, world = cfg.actor.fsdp_config, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if fsdp.fsdp_size == -1 and world > 0 and cfg.trainer.backend == "torch":
        fsdp.fsdp_size = world


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
