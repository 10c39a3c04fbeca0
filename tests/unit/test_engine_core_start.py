"""How a vLLM engine's core process starts (stages/engines/vllm_core.py), without vLLM: which engines get a
forkserver and with what environment, and that a process forked from that server dies with it (the server is the
actor's child, the core its grandchild: out of reach of Ray's clean-up of a dead worker's children).
tests/pipeline/test_partial_rollout.py checks the layout of a real engine."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from stages.engines.vllm_core import engine_core_env, environment
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]

# A parent that forks two children from its forkserver (preloading nothing): one a CoreProcess, one a plain
# forkserver process, each writing its pid, its parent's pid and how many objects it found frozen out of the garbage
# collector's sight, then waiting forever. One os.write per line: print's pieces from two processes interleave on the
# shared pipe.
SCRIPT = """
import gc, os, threading
from multiprocessing.context import ForkServerContext
from stages.engines.vllm_core import CoreContext

def report(name):
    os.write(1, f"{name} {os.getpid()} {os.getppid()} {gc.get_freeze_count()}\\n".encode())
    threading.Event().wait()

if __name__ == "__main__":
    for context in (CoreContext(), ForkServerContext()):
        context.set_forkserver_preload([])
        context.Process(target=report, args=(type(context).__name__,), daemon=True).start()
    threading.Event().wait()
"""


@pytest.fixture
def forked(tmp_path):
    (tmp_path / "forks.py").write_text(SCRIPT)  # a file: the children import their target from it
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "forks.py"], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
    lines = [parent.stdout.readline().split() for _ in range(2)]
    children = {name: (int(pid), int(ppid), int(frozen)) for name, pid, ppid, frozen in lines}
    yield parent, children
    for pid, *_ in children.values():  # ours, started above
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    parent.kill()
    parent.wait()


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_core_forked_from_the_server_dies_with_it_and_a_plain_fork_does_not(forked):
    parent, children = forked
    (core, server, _), (plain, plain_server, _) = children["CoreContext"], children["ForkServerContext"]
    assert server == plain_server != parent.pid and psutil.Process(server).ppid() == parent.pid
    os.kill(server, signal.SIGKILL)
    wait_until(lambda: not alive(core), 10, "the core ending with its forkserver", poll_s=0.05)
    assert alive(plain)  # what the core would do without CoreProcess: run on, orphaned


def test_a_core_starts_with_what_it_inherited_frozen_out_of_the_collectors_sight(forked):
    _, children = forked
    assert children["CoreContext"][2] > 10_000 and children["ForkServerContext"][2] == 0


def test_only_a_one_rank_cpu_engine_gets_an_environment_of_its_own():
    threads = str(max(1, len(os.sched_getaffinity(0)) - 1))
    assert engine_core_env(1, gpu=False) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": threads}
    assert engine_core_env(2, gpu=False) == {} and engine_core_env(1, gpu=True) == {}


def test_the_environment_holds_inside_the_block_and_is_restored_after_it(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with environment({"OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}):
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


def test_a_cpu_build_of_torch_is_known_without_importing_torch():
    probe = "import sys; from stages.engines.vllm_core import on_gpu; print(on_gpu(), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_another_build_of_torch_is_asked_for_its_devices(monkeypatch):
    from importlib import metadata

    import torch

    from stages.engines import vllm_core

    monkeypatch.setattr(metadata, "version", lambda name: "2.13.0")  # as a CUDA wheel from PyPI names itself
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_core.on_gpu() is True
