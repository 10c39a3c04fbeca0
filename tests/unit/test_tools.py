"""Tools: the calculator's safe arithmetic, and the Python sandbox with real subprocesses. Each misbehaving snippet
must be stopped or refused, with the reason recorded, and the parent must come to no harm."""

from __future__ import annotations

import asyncio
import os

import pytest

from stages.tools import ToolError, make_tools
from stages.tools.calculator import evaluate
from stages.tools.python_sandbox import PythonSandbox


def test_calculator_evaluates_arithmetic_and_refuses_anything_else():
    assert evaluate("347 * 29") == 10063
    assert evaluate("(2 + 3) ** 2 // 4 % 5") == 1 and evaluate("-(2 + 3) * 2.5") == -12.5
    for expr, message in [
        ("__import__('os').system('id')", "not Call"),
        ("x + 1", "not Name"),
        ("1/0", "division by zero"),
        ("9 ** 9 ** 9", "exponent"),
        ("1 +", "cannot parse"),
        ("", "needs"),
    ]:
        with pytest.raises(ToolError, match=message):
            evaluate(expr)


def test_make_tools_names_the_available_ones():
    assert set(make_tools(["calculator"])) == {"calculator"}
    with pytest.raises(ValueError, match="available: calculator, python"):
        make_tools(["browser"])


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox(timeout_s=3.0, memory_mb=256, cpu_s=1)


def run(sandbox, code):
    return asyncio.run(sandbox.run(code))


def test_a_normal_script_returns_its_stdout_and_may_use_its_directory(sandbox):
    result = run(
        sandbox, "open('notes.txt', 'w').write('kept'); import math; print(open('notes.txt').read(), math.factorial(5))"
    )
    assert result.error is None and result.returncode == 0 and result.stdout == "kept 120\n"
    assert asyncio.run(sandbox({"code": "print(6 * 7)"})) == "42\n"


def test_an_infinite_loop_hits_the_cpu_limit():
    # A wall-clock limit far beyond the CPU limit: however loaded the machine, the loop's second of CPU comes first.
    result = run(PythonSandbox(timeout_s=600.0, memory_mb=256, cpu_s=1), "while True:\n    pass")
    assert result.returncode is not None and result.returncode < 0 and "RLIMIT_CPU" in result.error


def test_a_sleeping_script_hits_the_wall_clock_limit():
    # It spends no CPU: only the wall-clock limit can end it.
    result = run(PythonSandbox(timeout_s=3.0, memory_mb=256, cpu_s=600), "import time\ntime.sleep(600)")
    assert "timed out after 3.0s" in result.error


def test_a_too_large_allocation_is_refused(sandbox):
    result = run(sandbox, "block = bytearray(2 * 1024 ** 3)")
    assert "memory limit of 256 MiB" in result.error and "MemoryError" in result.error


def test_opening_a_socket_is_refused(sandbox):
    result = run(sandbox, "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
    assert result.returncode == 1 and "network access is refused" in result.error


def test_writing_outside_its_directory_is_refused(sandbox, tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os; os.open({str(target)!r}, os.O_CREAT | os.O_WRONLY)",
        "open('../escaped.txt', 'w').write('x')",
        f"import os; os.mkdir({str(tmp_path / 'd')!r})",
    ):
        result = run(sandbox, code)
        assert "outside the sandbox directory is refused" in result.error, code
    assert not target.exists() and not (tmp_path / "d").exists()


def test_starting_processes_is_refused(sandbox):
    for code in ("import os; os.fork()", "import subprocess; subprocess.run(['true'])", "import os; os.system('true')"):
        assert "starting or signalling processes is refused" in run(sandbox, code).error


def test_a_failing_script_reports_its_exception_and_the_tool_raises_tool_error(sandbox):
    assert run(sandbox, "1 / 0").error == "ZeroDivisionError: division by zero"
    with pytest.raises(ToolError, match="ZeroDivisionError"):
        asyncio.run(sandbox({"code": "1 / 0"}))


def test_the_sandbox_directory_is_removed(sandbox):
    result = run(sandbox, "import os; print(os.getcwd())")
    assert result.error is None and not os.path.exists(result.stdout.strip())
