"""What the Generate stage needs to know about its vLLM engine beyond the engine's own API: the model's EOS id, the
engine-core processes, whether an error means the engine died, and per-token versions from its version spans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def eos_token_id(model_dir: str) -> int:
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return eos[0] if isinstance(eos, list) else int(eos)
    raise ValueError(f"{model_dir} declares no eos_token_id in generation_config.json or config.json")


def engine_dead(err: BaseException) -> bool:
    """Whether `err` says the engine core process is gone (vLLM's EngineDeadError), at any depth of causes."""
    from vllm.v1.engine.exceptions import EngineDeadError

    while err is not None:
        if isinstance(err, EngineDeadError):
            return True
        err = err.__cause__ or err.__context__
    return False


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def expand_spans(spans: Any, num_tokens: int, sample_id: str) -> list[int]:
    """Per-token versions from the engine's [(version, start, end)] spans."""
    if num_tokens == 0:
        return []
    if not spans:
        raise RuntimeError(f"{sample_id}: the engine reported no weight version for its tokens")
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise RuntimeError(f"{sample_id}: version spans cover {len(versions)} tokens, the response has {num_tokens}")
    return versions


def engine_pids(engine: Any) -> list[int]:
    """The engine-core processes of an AsyncLLM (one per engine with the uni executor), for processes.json."""
    manager = getattr(getattr(engine.engine_core, "resources", None), "engine_manager", None)
    return [p.pid for p in getattr(manager, "processes", [])]
