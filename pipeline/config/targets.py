"""`_target_` resolution for declaratively swapped stages: a spec's class and keywords, checked against the
constructor's signature, and an error that names the new path of a class that has moved."""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from pipeline.config.schema import ConfigError

# Classes that moved, by their old dotted path: a user's config that still names one gets the new one.
MOVED_TARGETS = {
    "stages.sim_generate.SimGenerate": "stages.sim.generate.SimGenerate",
}


def check_moved(target: str, key: str) -> None:
    if target in MOVED_TARGETS:
        raise ConfigError(f"{key}._target_ '{target}' has moved: use '{MOVED_TARGETS[target]}'.")


def import_target(target: str, key: str) -> type:
    module_name, _, attr = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}._target_ '{target}' cannot be imported ({err}).") from None


def stage_kwargs(spec: dict[str, Any], key: str) -> tuple[str, dict[str, Any]]:
    """Split a stage spec into its target and constructor keywords, checked against the signature.

    The class itself is imported later, by the wiring (check_signature), so that loading a config imports no
    stage code and `asyncrl --help` stays instant.
    """
    if not isinstance(spec, dict) or "_target_" not in spec:
        raise ConfigError(f"{key} needs a '_target_' naming the stage class (e.g. stages.reward.Reward).")
    check_moved(spec["_target_"], key)
    kwargs = {k: v for k, v in spec.items() if k != "_target_"}
    return spec["_target_"], kwargs


def stage_class(spec: dict[str, Any], key: str) -> tuple[type, dict[str, Any]]:
    """The class a stage spec names, imported, and the spec's own constructor keywords."""
    target, extra = stage_kwargs(spec, key)
    return import_target(target, key), extra


def bind(cls: type, key: str, wiring: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`cls`'s constructor arguments: exactly what the stream gives this kind of stage (`wiring`) plus the spec's own
    keywords, checked against the constructor now. A class that lacks one of them (a parameter renamed, say) or needs
    one more is one ConfigError naming it, not a default taken in silence or an error inside a Ray actor."""
    check_signature(cls, extra, key, provided=set(wiring))
    kwargs = {**wiring, **extra}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(
            f"{key}._target_ {cls.__module__}.{cls.__qualname__} does not take the arguments the stream gives it: "
            f"{err}. It is built with {', '.join(sorted(kwargs))}."
        ) from None
    return kwargs


def check_signature(cls: type, kwargs: dict[str, Any], key: str, provided: set[str] = frozenset()) -> None:
    """Fail with the nearest valid name when a configured keyword is not a constructor parameter."""
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for name in kwargs:
        if name not in params:
            close = difflib.get_close_matches(name, params, n=1, cutoff=0.5)
            hint = f" Did you mean '{close[0]}'?" if close else f" It takes: {', '.join(params)}."
            raise ConfigError(f"config key '{key}.{name}' is not a parameter of {cls.__name__}.{hint}")
        if name in provided:
            raise ConfigError(f"config key '{key}.{name}' is set by the wiring from the top-level config.")


def advantage_wiring(cfg, cls: type) -> dict[str, Any]:
    """What the stream gives an advantage stage of class `cls` from the top-level config (a RunConfig, or a run's
    config.yaml as read back by the audit): the group size to every estimator, the KL settings when the reward pays a
    KL, GRPO its std switch, GDPO its reward keys and weights, REINFORCE++ its discount."""
    from stages.advantage import GDPOAdvantage, GRPOAdvantage, ReinforcePlusPlusAdvantage  # loading a config: no stage

    alg = cfg.algorithm
    wiring: dict[str, Any] = {"group_size": cfg.rollout.n}
    if alg.use_kl_in_reward:
        wiring |= {"kl_in_reward": True, "kl_coef": alg.kl_ctrl.kl_coef, "kl_penalty": alg.kl_penalty}
    if issubclass(cls, GRPOAdvantage):
        wiring["norm_by_std"] = alg.norm_adv_by_std_in_grpo
    if issubclass(cls, GDPOAdvantage):
        wiring |= {"reward_keys": alg.gdpo_reward_keys, "reward_weights": alg.gdpo_reward_weights}
    if issubclass(cls, ReinforcePlusPlusAdvantage):
        wiring["gamma"] = alg.gamma
    return wiring
