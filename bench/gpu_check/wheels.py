"""The wheels the GPU check needs beyond what a bare GPU machine has, and the command that fetches them.

The lent GPU machine (Python 3.12, torch with CUDA, transformers, safetensors, numpy, pyarrow) has no megatron-core
and cannot download: its wheels travel with the source. The check imports no Ray, vLLM, omegaconf or MLflow (the
trainer's classes are built directly, not from the run config), so megatron-core is all it lacks; its own
requirements (torch, numpy, packaging) are there.

    python -m bench.gpu_check.wheels .whl     # here, with network: cp312 manylinux wheels into .whl
    # there:
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

WHEELS = ("megatron-core==0.16.1",)
PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def download_command(out: Path) -> list[str]:
    """pip's download of WHEELS as binary wheels for CPython PYTHON on x86-64 manylinux, without their requirements."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", PYTHON, "--implementation", "cp", *platforms, "-d", str(out), *WHEELS,
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, nargs="?", default=Path(".whl"))
    args = parser.parse_args()
    subprocess.run(download_command(args.out), check=True)


if __name__ == "__main__":
    main()
