"""Pipeline parallelism changes nothing but the layout: PP = 2 (and TP = 2 x PP = 2) over gloo exports exactly the
HF tensors the model was loaded from and trains with PP = 1's logprobs, losses and grad norms, through megatron's
own 1F1B schedule on CPU.

Each layout runs as real processes on 127.0.0.1 (torch.multiprocessing, spawn), each rank a MegatronRank built
from the embedded model's HF directory (2 layers: one per stage), untied as built and tied (the same weights with
`tie_word_embeddings` and no lm_head), where the last stage holds a copy of the embedding that megatron keeps
equal through the embedding group. Rank 0 (the first stage) exports the whole model; the last stage computes the
logprobs and the losses. Tolerances as tests/distributed/test_megatron_tp.py: 1e-5 relative on losses and grad
norms, 1e-5 absolute on logprobs, 1e-4 absolute on the weights after the steps.
"""

import numpy as np
import pytest
import torch

from tests.distributed.megatron_layouts import TOL

LAYOUTS = {"untied": [(1, 1), (1, 2), (2, 2)], "tied": [(1, 1), (1, 2)]}  # (TP, PP)


@pytest.fixture(scope="module")
def runs(megatron_layouts):
    layouts = megatron_layouts  # the session's (conftest.py): PP = 1 is TP = 1 of test_megatron_tp.py
    return layouts.model_dirs, {(k, tp, pp): layouts.run(k, tp, pp) for k, grid in LAYOUTS.items() for tp, pp in grid}


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_export_of_the_loaded_model_is_its_hf_weights(runs, kind):
    from safetensors.torch import load_file

    dirs, results = runs
    hf = load_file(f"{dirs[kind]}/model.safetensors")
    if kind == "tied":  # vLLM keeps its own head: the export sends it too, or it stays stale
        hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    for tp, pp in LAYOUTS[kind]:
        got = results[(kind, tp, pp)]
        assert got["meta"] == results[(kind, 1, 1)]["meta"]  # names, full shapes and order of PP = 1
        assert list(got["start"]) == got["meta"]["names"]
        assert set(got["start"]) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(torch.from_numpy(got["start"][name]), tensor), (kind, tp, pp, name)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_pp2_trains_with_the_losses_of_pp1(runs, kind):
    _, results = runs
    one = results[(kind, 1, 1)]
    assert len({s["actor/pg_loss"] for s in one["steps"]}) > 1  # the steps really changed the weights
    for tp, pp in LAYOUTS[kind][1:]:
        other = results[(kind, tp, pp)]
        for column in ("logprobs", "sum_pi2"):  # sum pi^2: the optimal token baseline's, through the schedule
            np.testing.assert_allclose(
                [x for r in one[column] for x in r], [x for r in other[column] for x in r], rtol=0, atol=TOL
            )
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "train/ratio_mean"):
            a = [s[key] for s in one["steps"]]
            b = [s[key] for s in other["steps"]]
            print(kind, key, "PP=1", a, f"TP={tp} PP={pp}", b)
            np.testing.assert_allclose(a, b, rtol=TOL, atol=1e-7)
        for name in one["end"]:
            np.testing.assert_allclose(one["end"][name], other["end"][name], rtol=0, atol=10 * TOL, err_msg=name)
            assert not np.array_equal(one["end"][name], one["start"][name]) or "norm" in name


def test_the_backend_at_pp2_dp2_trains_exports_and_resumes_as_pp1(ray_session, megatron_one_rank, tmp_path):
    """MegatronTrainer (rank 0 a Ray actor starting its peers, as in a run) with PP = 2 x DP = 2: each replica's
    results come from its last stage, the export from rank 0, and its checkpoint (the first replica's two stages'
    optimizer states) resumes at PP = 2 and DP = 1. Against the one-rank MegatronTrainer of test_megatron_dp.py."""
    from stages.trainer.megatron_backend import MegatronTrainer
    from tests.distributed.test_megatron_dp import POLICY, _assert_same_metrics, _assert_same_weights, _published

    ray, base = ray_session, megatron_one_rank
    model_dir = base.model_dir
    remote = ray.remote(MegatronTrainer).options(num_cpus=0)

    def trainer(pp: int = 1, dp: int = 1, model: str = model_dir, optimizer_state: str | None = None):
        return remote.remote(
            model,
            policy=POLICY,
            compute_prox_log_prob=True,
            pipeline_model_parallel_size=pp,
            data_parallel_size=dp,
            optimizer_state=optimizer_state,
        )

    batch, start, meta, first, second, end = base.batch, base.start, base.meta, base.first, base.second, base.end
    grid = trainer(pp=2, dp=2)
    assert ray.get(grid.weight_meta.remote()) == meta
    _assert_same_weights(_published(ray, grid, tmp_path / "grid_start.safetensors"), start, exact=True)
    prompts = [r for mb in batch for r in mb["prompt_ids"]]
    responses = [r for mb in batch for r in mb["response_ids"]]
    got = ray.get(grid.logprobs.remote(prompts, responses))  # each replica's last stage, back in the rows' order
    want = [r for mb in batch for r in (np.asarray(x) + 0.2 for x in mb["ref_logprobs"])]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    _assert_same_metrics(ray.get(grid.train_step.remote(batch)), first)
    ray.get(grid.save_checkpoint.remote(str(tmp_path / "ckpt")))
    ray.kill(grid)  # its peers end with it

    ckpt = tmp_path / "ckpt"
    resumed = trainer(pp=2, model=str(ckpt / "model"), optimizer_state=str(ckpt / "optimizer.pt"))
    _assert_same_metrics(ray.get(resumed.train_step.remote(batch)), second)  # AdamW's moments came back too
    _assert_same_weights(_published(ray, resumed, tmp_path / "resumed_end.safetensors"), end, steps=2)
    ray.kill(resumed)
