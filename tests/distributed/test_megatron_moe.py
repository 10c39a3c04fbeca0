"""The Megatron trainer on a Qwen3-MoE (tests/moe_model.py): megatron-core's MoE computes transformers' logits, its
export is the HF checkpoint, and routing replay through megatron-core's RouterReplay forces the same experts as
the torch trainer's replay (the same logprobs to 1e-5), leaves the model's own routes unchanged, keeps the
router's gradient and reports actor/router_mismatch.

The rank runs in a spawned process (megatron-core's parallel state is per process), TP=1 on gloo; the torch
trainer, the reference, runs here. Tolerance 1e-5 on logprobs: the two implementations sum in another order.
"""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from stages.trainer.settings import PolicySettings, RouterReplaySettings
from stages.trainer.step import pad_routes
from stages.trainer.torch_backend import TorchTrainer
from tests.moe_model import batch, build_tiny_moe, minibatch, other_routes, own_routes

R3 = PolicySettings(router_replay=RouterReplaySettings(mode="R3"), micro_batch_size=2, lr=1e-3)
TOL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(model_dir: str, port: int, queue) -> None:
    from stages.trainer.megatron_rank import MegatronRank

    rank = MegatronRank(model_dir, 0, 1, port, policy=R3)
    prompts, responses = batch()
    own = own_routes(model_dir, prompts, responses)

    def forward(routes):
        fwd = rank._token_logprobs(prompts, responses, routes=pad_routes(prompts, responses, routes))
        replayed, changed = fwd.route_maps  # (B, S) per token: they add up to the counts, in batch-major order
        context = sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True))
        assert int((replayed == 2).sum()) == context and int((replayed == 0).sum()) == replayed.numel() - context
        assert bool((changed <= replayed).all())  # 2 MoE layers on every context token but the last, none elsewhere
        assert replayed.shape == (len(prompts), max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True)))
        assert float(replayed[0, len(prompts[0]) + len(responses[0]) - 1 :].sum()) == 0  # its last token, padding
        return fwd.logp.detach().numpy(), fwd.routes_replayed, fwd.routes_changed

    # numpy, not tensors: a tensor crosses the queue as a shared-memory handle that dies with this process
    out = {
        "plain": rank._token_logprobs(prompts, responses).logp.detach().numpy(),
        "own": forward(own),
        "forced": forward(other_routes(own)),
        "export": {name: t.numpy().copy() for name, t in rank.export()},
        "meta": rank.hf_meta(),
        "own_step": rank.train_step([minibatch(prompts, responses, own)]),
    }
    out["forced_step"] = rank.train_step([minibatch(prompts, responses, other_routes(own))], recompute=True)
    out["router_grads"] = [float(m.weight.grad.abs().sum()) for m in rank.replay.routers]
    queue.put(out)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def run(request, tmp_path_factory):
    model_dir = str(build_tiny_moe(tmp_path_factory.mktemp("moe"), norm_topk_prob=request.param))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(model_dir, _free_port(), queue))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return model_dir, result


def test_megatron_moe_computes_transformers_logprobs(run):
    model_dir, result = run
    prompts, responses = batch()
    reference = TorchTrainer(model_dir)._token_logprobs(prompts, responses).logp.detach()
    torch.testing.assert_close(torch.from_numpy(result["plain"]), reference, rtol=0, atol=TOL)


def test_export_is_the_hf_checkpoint(run):
    from safetensors.torch import load_file

    model_dir, result = run
    hf = load_file(f"{model_dir}/model.safetensors")
    assert set(result["export"]) == set(hf)
    assert all(torch.equal(torch.from_numpy(result["export"][k]), hf[k]) for k in hf)
    assert result["meta"]["names"] == list(result["export"])
    assert result["meta"]["shapes"] == [list(result["export"][n].shape) for n in result["meta"]["names"]]


def test_replay_forces_the_same_experts_as_the_torch_trainer(run):
    model_dir, result = run
    prompts, responses = batch()
    plain = torch.from_numpy(result["plain"])
    logp, replayed, changed = result["own"]
    torch.testing.assert_close(torch.from_numpy(logp), plain, rtol=0, atol=1e-6)  # own routes: nothing moves
    assert replayed > 0 and changed == 0
    logp, replayed, changed = result["forced"]
    logp = torch.from_numpy(logp)
    assert (logp - plain).abs().max() > 1e-3
    assert changed == replayed > 0
    torch_forced = TorchTrainer(model_dir, policy=R3)._token_logprobs(
        prompts, responses, routes=pad_routes(prompts, responses, other_routes(own_routes(model_dir, *batch())))
    )
    torch.testing.assert_close(logp, torch_forced.logp.detach(), rtol=0, atol=TOL)


def test_replay_keeps_router_gradients_and_reports_the_mismatch(run):
    _, result = run
    assert result["own_step"]["actor/router_mismatch"] == 0.0
    # After the first step's update a few shifted routes may now be the router's own choice too.
    assert 0.9 < result["forced_step"]["actor/router_mismatch"] <= 1.0
    assert result["forced_step"]["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)  # anchors replayed too
    assert all(g > 0 for g in result["router_grads"])
