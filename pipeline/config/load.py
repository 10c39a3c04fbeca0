"""Loading a run configuration: defaults <- YAML file <- `key=value` overrides, merged by omegaconf into the typed
schema (pipeline/config/schema.py), then the cross-field checks (pipeline/config/checks.py).

verl's long prefixes `actor_rollout_ref.actor.` and `actor_rollout_ref.rollout.` are accepted and translated.
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
VERL_PREFIXES = {"actor_rollout_ref.actor.": "actor.", "actor_rollout_ref.rollout.": "rollout."}


def _translate_verl(override: str) -> str:
    for long, short in VERL_PREFIXES.items():
        if override.startswith(long):
            return short + override[len(long) :]
    return override


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
    layers.append(OmegaConf.load(cfg_path))
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"override {bad[0]!r} is not of the form key=value (e.g. rollout.n=4).")
    layers.append(OmegaConf.from_dotlist([_translate_verl(o) for o in overrides]))
    try:
        merged = OmegaConf.merge(*layers)
        cfg: RunConfig = OmegaConf.to_object(merged)
    except (ConfigKeyError, ValidationError) as err:
        raise _explain(err, schema) from None
    except ValueError as err:  # a dataclass's own range check (sim.*)
        raise ConfigError(str(err)) from None

    validate(cfg)
    return cfg


def to_yaml(cfg: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
