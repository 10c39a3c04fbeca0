"""verl's fully_async example scripts as override lists (tests/fixtures/verl_fully_async/, one per script), and what
loading each of their keys does. Run it to count the scripts' distinct keys by outcome:

    .venv/bin/python -m tests.verl_recipes            # the counts
    .venv/bin/python -m tests.verl_recipes --keys     # and every key with its outcome

A key's outcome, loading it alone over the defaults (a Megatron script's keys with trainer.backend=megatron, as verl
picks Megatron by its config file): 'applied' (it loads and sets what it means), 'noted' (accepted, listed as having
no effect, with why), 'refused' (a ConfigError that names why: a capability asyncrl lacks, or a value it cannot take)
or 'unknown' (the loader does not know the key).
"""

from __future__ import annotations

import sys
from collections import Counter
from functools import cache
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "verl_fully_async"
PLACEHOLDERS = {
    "{TRAIN_FILE}": "/data/train.parquet",
    "{VAL_FILE}": "/data/val.parquet",
    "{MODEL_PATH}": "/models/model",
    "{CKPTS_DIR}": "/ckpts/run",
    "{REWARD_FN}": str(FIXTURES / "reward_fn.py"),
    "{TOOL_CONFIG}": "/configs/tool_config.yaml",
    "{DATASET_CLS}": "/code/dataset.py",
}
# verl chooses the trainer by its config file; these are ours for the same choice.
CONFIGS = {
    "fully_async_ppo_trainer.yaml": [],
    "fully_async_dapo_trainer.yaml": [],
    "fully_async_ppo_megatron_trainer.yaml": ["trainer.backend=megatron"],
}


def recipe(name: str) -> tuple[list[str], list[str]]:
    """(our overrides for verl's config file, the script's overrides with the placeholders filled)."""
    config, overrides = "fully_async_ppo_trainer.yaml", []
    for line in (FIXTURES / f"{name}.txt").read_text().splitlines():
        if line.startswith("# config:"):
            config = line.split(":", 1)[1].strip()
        elif line and not line.startswith("#"):
            for placeholder, value in PLACEHOLDERS.items():
                line = line.replace(placeholder, value)
            overrides.append(line)
    return CONFIGS[config], overrides


def recipes() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.txt"))


def key_of(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+")


@cache
def _schema():
    from omegaconf import OmegaConf

    from pipeline.config.schema import RunConfig

    return OmegaConf.structured(RunConfig)


def classify(override: str) -> tuple[str, str]:
    """What the loader does with one override, without loading it: (kind, our spelling of the key), kind 'schema' (a
    key the schema has), 'noted' or 'capability' (verl_keys.RULES), 'efficiency' (left to the trainer-efficiency
    settings) or 'unknown'."""
    from omegaconf import OmegaConf

    from pipeline.config.load import _in_schema, _leaves, _translate_verl
    from pipeline.config.verl_keys import efficiency_key, rule_of

    key, value = override.lstrip("+").split("=", 1)
    layer = _translate_verl(OmegaConf.from_dotlist([f"{key}={value}"]))
    (ours,) = _leaves(layer) or [key]
    if _in_schema(_schema(), ours):
        return "schema", ours
    if efficiency_key(ours):
        return "efficiency", ours
    rule = rule_of(ours)
    if rule is None:
        return "unknown", ours
    return ("capability" if rule.capability else "noted"), ours


def outcome(base: list[str], override: str) -> tuple[str, str]:
    """(outcome, the notice or error) of one override loaded alone over `base`."""
    from pipeline.config import ConfigError, load_config

    try:
        cfg = load_config(None, [*base, override])
    except ConfigError as err:
        message = str(err)
        return ("unknown" if " not in '" in message else "refused"), message
    notices = getattr(cfg, "notices", [])
    noted = [n for n in notices if n.startswith(key_of(override).replace("actor_rollout_ref.", ""))]
    return ("noted", noted[0]) if noted else ("applied", "")


def outcomes() -> dict[str, tuple[str, str]]:
    """Every distinct key of every script: its outcome (the first script's that uses it)."""
    seen: dict[str, tuple[str, str]] = {}
    for name in recipes():
        base, overrides = recipe(name)
        for override in overrides:
            key = key_of(override)
            if key not in seen:
                seen[key] = outcome(base, override)
    return seen


def main() -> None:
    seen = outcomes()
    counts = Counter(kind for kind, _ in seen.values())
    print(f"{len(recipes())} scripts, {len(seen)} distinct keys: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if "--keys" in sys.argv:
        for key, (kind, why) in sorted(seen.items()):
            print(f"{kind:8} {key}  {why[:160]}")


if __name__ == "__main__":
    main()
