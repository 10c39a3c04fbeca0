"""The tree's layering, checked on every import statement (lazy ones inside functions too):

    schemas  <-  stages  <-  pipeline helpers (config <- tasks, observe, sim)  <-  the driver (pipeline/*.py)

An arrow points from what is imported to its importer; nothing imports upward. bench/, infra/ and tests/ sit on top.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HELPERS = ("pipeline.config", "pipeline.tasks", "pipeline.observe", "pipeline.sim")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return [m for m in out if m.split(".")[0] in ("schemas", "stages", "pipeline")]


def _layer(module: str) -> str:
    top = module.split(".")[0]
    if top != "pipeline":
        return top
    for helper in HELPERS:
        if module == helper or module.startswith(helper + "."):
            return helper
    return "pipeline" if module == "pipeline" else "driver"


# What each layer may import (besides itself).
ALLOWED = {
    "schemas": set(),
    "stages": {"schemas"},
    "pipeline.config": {"schemas", "stages"},
    "pipeline.tasks": {"schemas", "stages", "pipeline.config"},
    "pipeline.observe": {"schemas", "stages", "pipeline.config"},
    "pipeline.sim": {"schemas", "stages", "pipeline.config"},
    "driver": {"schemas", "stages", "pipeline", *HELPERS},
}

SOURCES = sorted(p for d in ("schemas", "stages", "pipeline") for p in (ROOT / d).rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    layer = _layer(_module(path))
    if layer == "pipeline":  # the package's __init__ holds only a docstring
        assert not _imports(path)
        return
    own = {layer, "pipeline"} if layer.startswith("pipeline") or layer == "driver" else {layer}
    upward = [m for m in _imports(path) if _layer(m) not in ALLOWED[layer] | own]
    assert not upward, f"{path.relative_to(ROOT)} ({layer}) imports upward: {upward}"


def test_pipeline_itself_holds_only_the_driver():
    driver = sorted(p.stem for p in (ROOT / "pipeline").glob("*.py") if p.stem != "__init__")
    assert len(driver) <= 12, driver
    assert "run" in driver and "config" not in driver
