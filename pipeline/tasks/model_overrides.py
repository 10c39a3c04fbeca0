"""verl's `model.override_config`: the model's config.json with some of its values replaced, for the trainer and the
engines alike (verl passes them to both; its DAPO scripts raise max_position_embeddings this way).

The user's model directory is never written: the run gets a directory of its own, `<run>/model_overridden`, whose
config.json carries the overrides (nested dicts merged key by key) and whose other files link to the originals. The
embedded model, built inside the run directory, is overridden in place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def merged(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` applied, a nested dict merged key by key."""
    out = dict(config)
    for key, value in overrides.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def apply_overrides(model_dir: Path, overrides: dict[str, Any], run_dir: Path, in_place: bool = False) -> Path:
    """The model directory to load: `model_dir` itself without overrides; else one whose config.json has them."""
    if not overrides:
        return model_dir
    config = json.loads((model_dir / "config.json").read_text())
    target = model_dir if in_place else run_dir / "model_overridden"
    if not in_place:
        target.mkdir(parents=True, exist_ok=True)
        for f in model_dir.iterdir():
            link = target / f.name
            if f.name != "config.json" and not link.exists():
                link.symlink_to(f.resolve())
    (target / "config.json").write_text(json.dumps(merged(config, overrides), indent=2))
    return target
