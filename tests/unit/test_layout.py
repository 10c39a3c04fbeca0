"""The tree's layering, checked on every import statement (lazy ones inside functions too):

    schemas  <-  stages  <-  pipeline helpers (config <- tasks, observe, sim)  <-  the driver (pipeline/*.py)

An arrow points from what is imported to its importer; nothing imports upward. bench/, infra/ and tests/ sit on top.
Inside stages/ the rooms (ROOMS) import only what they build on, stages reach the VersionClock only through
stages.control.ClockLink, and every call they make on it exists on the clock.
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


def _calls(path: Path, attribute: str) -> list[int]:
    """Lines of `path` that call something named `attribute`."""
    tree = ast.parse(path.read_text())
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attribute
    ]


def test_stages_reach_the_clock_only_through_its_link():
    """A stage finds the VersionClock's actor only in stages/control.py (ClockLink), so every call it makes on the
    clock is one that the next test checks."""
    stages = sorted((ROOT / "stages").rglob("*.py"))
    found = {str(p.relative_to(ROOT)): _calls(p, "get_actor") for p in stages if p.name != "control.py"}
    assert not {p: lines for p, lines in found.items() if lines}, "find the clock with stages.control.ClockLink"


def test_every_clock_call_a_stage_makes_exists_on_the_clock():
    """The clock's API as the stages use it at run time: each call of stages.control's protocols is a coroutine of
    the VersionClock with the same parameters, ClockLink implements it, and every actor method ClockLink calls exists
    (a renamed clock method would otherwise fail only inside a running replica)."""
    import inspect

    from pipeline.clock import VersionClock
    from stages.control import ClockLink, GateClock, ReplicaClock

    def params(fn) -> list[str]:
        return [p for p in inspect.signature(fn).parameters if p != "self"]

    for protocol in (ReplicaClock, GateClock):
        for name, spec in vars(protocol).items():
            if name.startswith("_") or not callable(spec):
                continue
            clock = getattr(VersionClock, name, None)
            assert inspect.iscoroutinefunction(clock), f"VersionClock has no coroutine {name}, which stages call"
            assert params(clock) == params(spec), (name, params(clock), params(spec))
            assert params(getattr(ClockLink, name)) == params(spec), f"ClockLink.{name}"
    tree = ast.parse((ROOT / "stages" / "control.py").read_text())
    called = {
        n.value.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "remote" and isinstance(n.value, ast.Attribute)
    }
    assert called and all(inspect.iscoroutinefunction(getattr(VersionClock, c, None)) for c in called), called


# Rooms inside stages/ and what each may import of stages/ besides itself (schemas/ always): the transports need
# torch alone (a pair runs without the rest), the control plane only names the transports' types, an engine knows
# nothing of the replica above it (its core process dies with its parent as the reward workers do: stages.fate), and
# the replica knows engines only through their interface.
ROOMS = {
    "stages.ray_internals": set(),
    "stages.transports": set(),
    "stages.fate": set(),
    "stages.control": {"stages.transports"},
    "stages.engines": {
        "stages.agents",
        "stages.engine_busy",
        "stages.fate",
        "stages.transports",
        "stages.sim.workload",
    },
    "stages.replica": {"stages.agents", "stages.control", "stages.engines.base"},
}


def _room(module: str) -> str | None:
    return next((r for r in ROOMS if module == r or module.startswith(r + ".")), None)


@pytest.mark.parametrize("path", [p for p in SOURCES if _room(_module(p))], ids=lambda p: str(p.relative_to(ROOT)))
def test_each_room_imports_only_what_it_builds_on(path):
    room = _room(_module(path))
    allowed = ROOMS[room] | {room}
    ours = [m for m in _imports(path) if m.split(".")[0] == "stages"]
    outside = [m for m in ours if not any(m == a or m.startswith(a + ".") for a in allowed)]
    assert not outside, f"{path.relative_to(ROOT)} ({room}) imports {outside}; it may import {sorted(allowed)}"
