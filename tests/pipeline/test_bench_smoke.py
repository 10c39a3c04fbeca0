"""Every benchmark of docs/benchmarks.md in a smoke run (`--smoke`: a few seconds of its own code path on a tiny job;
bench/smoke.py), so that one that breaks shows here rather than the next time someone runs it. Each must end well,
print its table, and return (or print) results of the shape its table needs; the figures themselves mean nothing.

The benchmarks that run their jobs through pipeline.run share this session's Ray; those that start and stop a Ray
of their own run as the command the docs give, all at once. bench.routes' smoke runs its rounds and table on the
engine of test_moe_routes.py, which starts the same MoE engine with route capture.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# The benchmarks that run as commands of their own, started together by the first test that needs one: each is mostly
# one process's imports and start-up, so side by side they take about the time of the longest.
COMMANDS = ("handoff", "prompts_1m", "weight_sync", "data_parallel")


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    """`python -m bench.<module> --smoke` for every module of COMMANDS, all started now; each one's process and the
    files its stdout and stderr go to (a full pipe would block it)."""
    out = tmp_path_factory.mktemp("bench-smoke")
    started = {}
    for module in COMMANDS:
        stdout, stderr = out / f"{module}.out", out / f"{module}.err"
        with open(stdout, "w") as o, open(stderr, "w") as e:
            proc = subprocess.Popen([sys.executable, "-m", f"bench.{module}", "--smoke"], cwd=ROOT, stdout=o, stderr=e)
        started[module] = (proc, stdout, stderr)
    yield started
    for proc, _, _ in started.values():  # a test that failed early leaves nothing running
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def bench(commands: dict, module: str, timeout_s: float = 600) -> str:
    """The stdout of `module`'s smoke command, once it has ended well."""
    proc, stdout, stderr = commands[module]
    code = proc.wait(timeout_s)
    assert code == 0, stdout.read_text()[-3000:] + stderr.read_text()[-5000:]
    return stdout.read_text()


@pytest.mark.slow
def test_modes(ray_session, capsys):
    from bench.modes import main

    rows = main(["--smoke", "--syncs", "3"])
    assert list(rows) == [
        "colocated sync",
        "on-policy pipeline",
        "stream off-policy",
        "async stale samples",
        "async + partial rollout",
    ]
    for _cfg, result, _model, model_unit in rows.values():
        assert len(result["windows"]) == 1 and result["per_unit"] > 0 and model_unit > 0 and result["audit_ok"]
    out = capsys.readouterr().out
    assert "vs model" in out and "calibrated inputs" in out and "by construction" in out


@pytest.mark.slow
def test_overhead(ray_session, capsys):
    from bench.overhead import main

    rows = main(["--smoke"])
    assert [(ppc, where) for ppc, _calls, where, *_ in rows] == [(4, "stage"), (4, "engine")]
    assert all(rate > 0 and ok for *_, rate, _wall, ok in rows)
    assert "samples/s" in capsys.readouterr().out


@pytest.mark.slow
def test_learning(ray_session, capsys):
    from bench.learning import MODES, main

    results = main(["--smoke"])
    assert list(results) == list(MODES)
    assert all(summary["audit_ok"] and len(curve) == 4 for summary, _step, _wall, curve in results.values())
    assert "reward by quarter of the steps" in capsys.readouterr().out


@pytest.mark.slow
def test_pull(ray_session, capsys):
    from bench.pull import main

    results = main(["--smoke"])
    assert list(results) == ["push", "pull"]
    assert all(blocked and summary["audit_ok"] for blocked, _paused, summary in results.values())
    assert "push / pull" in capsys.readouterr().out


@pytest.mark.slow
def test_validation(ray_session, capsys):
    from bench.validation import SMOKE_MODES, main

    results = main(["--smoke"])
    assert list(results) == list(SMOKE_MODES)  # the dedicated engine's passes: test_pull.py, on vLLM
    for syncs, _publish, passes, summary in results.values():
        assert syncs and passes >= 1 and summary["audit_ok"]  # rows that carry a pass (0, 4 and 8 validated)
    assert "blocked s/sync" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_share(ray_session, capsys):
    from bench.cpu_share import main

    cores = main(["--smoke"])
    assert cores and sum(cores.values()) > 0
    assert "cores used per kind of process" in capsys.readouterr().out


@pytest.mark.slow
def test_multi_turn(ray_session, capsys):
    from bench.multi_turn import main

    table = main(["--smoke"])  # the smoke's runs in this process, on the session's Ray
    assert list(table) == ["sync", "partial"]
    assert all(m["s_per_step"] > 0 and m["windows"][0] > 0 and m["audit_ok"] for m in table.values())
    assert "engine idle" in capsys.readouterr().out


@pytest.mark.slow
def test_timeline_of_a_finished_run(partial_run, capsys):
    from bench.timeline import main

    rows = main([str(partial_run[1]), "--skip", "2"])
    assert rows and all(r["period"] > 0 for r in rows)
    assert "step to step" in capsys.readouterr().out


@pytest.mark.slow
def test_handoff(commands):
    out = bench(commands, "handoff")
    assert "hand-off (light columns only)" in out and "driver bytes, hand-off / whole" in out


@pytest.mark.slow
def test_prompts_1m(commands):
    out = bench(commands, "prompts_1m")
    assert "2,000 rows" in out and "are the layout's" in out


@pytest.mark.slow
def test_weight_sync(commands):
    out = bench(commands, "weight_sync")
    assert "push GB/s" in out and "packed is" in out


@pytest.mark.slow
def test_data_parallel(commands):
    out = bench(commands, "data_parallel")
    assert all(layout in out for layout in ("torch DP2", "megatron DP2xTP1", "megatron DP1xTP2"))
