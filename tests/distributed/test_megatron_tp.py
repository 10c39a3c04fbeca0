"""Tensor parallelism changes nothing but the layout: TP=2 over gloo trains with TP=1's losses.

Each layout runs as real processes on 127.0.0.1 (torch.multiprocessing, spawn), each rank a MegatronRank built
from the embedded model's HF directory. Both train the same three PPO steps on the same hand-built mini-batch.
Tolerance: 1e-5 relative on losses and grad norms, 1e-5 absolute on logprobs (the TP all-reduces sum in another
order). Weights after the steps: 1e-4 absolute, since AdamW normalises each gradient element: one whose gradient
is at rounding-noise level moves by up to lr (1e-4) per step in either layout.
"""

import numpy as np
import pytest
import torch

from tests.distributed.megatron_layouts import TOL


@pytest.fixture(scope="module")
def runs(megatron_layouts):
    layouts = megatron_layouts  # the session's (conftest.py): TP = 1 is PP = 1 of test_megatron_pp.py
    return layouts.model_dirs["untied"], {world: layouts.run("untied", world, 1) for world in (1, 2)}


def test_export_of_the_loaded_model_is_its_hf_weights(runs):
    from safetensors.torch import load_file

    model_dir, results = runs
    hf = load_file(f"{model_dir}/model.safetensors")
    for world in (1, 2):
        start = results[world]["start"]
        assert set(start) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(torch.from_numpy(start[name]), tensor), (world, name)


def test_tp2_trains_with_the_losses_of_tp1(runs):
    _, results = runs
    one, two = results[1], results[2]
    np.testing.assert_allclose(
        [x for r in one["logprobs"] for x in r], [x for r in two["logprobs"] for x in r], rtol=0, atol=TOL
    )
    # sum pi^2 over the vocabulary split between the two ranks (max and sums all-reduced)
    spi = [x for r in one["sum_pi2"] for x in r]
    np.testing.assert_allclose(spi, [x for r in two["sum_pi2"] for x in r], rtol=0, atol=TOL)
    assert 0 < min(spi) and max(spi) < 1
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "train/ratio_mean"):
        a = [s[key] for s in one["steps"]]
        b = [s[key] for s in two["steps"]]
        print(key, "TP=1", a, "TP=2", b)
        np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-7)
    assert len({s["actor/pg_loss"] for s in one["steps"]}) > 1  # the steps really changed the weights
    for name in one["end"]:
        np.testing.assert_allclose(one["end"][name], two["end"][name], rtol=0, atol=10 * TOL, err_msg=name)
        assert not np.array_equal(one["end"][name], one["start"][name]) or "norm" in name
