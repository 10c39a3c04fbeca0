"""The GPU check (bench/gpu_check) on this machine's GPU: every piece's checks hold (its table says which did not).
Needs CUDA and megatron-core, not Ray or vLLM: it runs on a bare GPU machine with the wheels of make gpu-check-wheels.
"""

import pytest

from bench.gpu_check.__main__ import main


@pytest.mark.gpu
def test_every_piece_of_the_gpu_check_passes(tmp_path):
    assert main(["--device", "cuda", "--out", str(tmp_path)]) == 0, (tmp_path / "table.md").read_text()
