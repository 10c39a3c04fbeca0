"""Routing replay (actor.router_replay.mode=R3) in the torch trainer and the shared step, on a tiny random
Qwen3-MoE (tests/moe_model.py): replaying the model's own routes changes nothing, other routes change the
logprobs, the router still gets gradients, actor/router_mismatch counts what differs, and a mini-batch without
routes is one clear error. The Megatron side: tests/distributed/test_megatron_moe.py."""

import numpy as np
import pytest
import torch

from pipeline.config import ConfigError, load_config
from stages.trainer.settings import PolicySettings, RouterReplaySettings
from stages.trainer.step import NO_ROUTE, Minibatch, StepTotals, pad_routes, route_row_versions
from stages.trainer.torch_backend import TorchTrainer
from tests.moe_model import batch, build_tiny_moe, minibatch, other_routes, own_routes

R3 = PolicySettings(router_replay=RouterReplaySettings(mode="R3"), micro_batch_size=2, lr=1e-3)


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "no_norm_topk"])
def moe(request, tmp_path_factory):
    """(model_dir, prompts, responses, the model's own routes)."""
    model_dir = build_tiny_moe(tmp_path_factory.mktemp("moe"), norm_topk_prob=request.param)
    prompts, responses = batch()
    return model_dir, prompts, responses, own_routes(model_dir, prompts, responses)


def _context_tokens(prompts, responses) -> int:
    return sum(len(p) + len(r) - 1 for p, r in zip(prompts, responses, strict=True))


def test_replaying_the_models_own_routes_changes_nothing(moe):
    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3)
    plain = TorchTrainer(str(model_dir))._token_logprobs(prompts, responses)  # transformers' own routers
    replayed = trainer._token_logprobs(prompts, responses, routes=pad_routes(prompts, responses, own))
    torch.testing.assert_close(replayed.logp, plain.logp, rtol=0, atol=1e-6)
    assert replayed.routes_replayed == 2 * _context_tokens(prompts, responses)  # 2 MoE layers
    assert replayed.routes_changed == 0


def test_other_routes_change_the_logprobs(moe):
    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3)
    plain = trainer._token_logprobs(prompts, responses)
    forced = trainer._token_logprobs(prompts, responses, routes=pad_routes(prompts, responses, other_routes(own)))
    assert (forced.logp - plain.logp).abs().max() > 1e-3
    assert forced.routes_changed == forced.routes_replayed == 2 * _context_tokens(prompts, responses)
    # The first position's experts are forced too: its logprob moves although no earlier token routes.
    assert not torch.allclose(forced.logp[:, 0], plain.logp[:, 0])


def _router_grads(trainer: TorchTrainer, rows: dict) -> list[torch.Tensor]:
    trainer.model.zero_grad(set_to_none=True)
    mb = Minibatch.of(rows, trainer.policy)
    mb.loss(trainer._token_logprobs, slice(0, 3), trainer.policy).total.backward()
    return [r.weight.grad.clone() for r in trainer.replay.routers]


def test_the_router_gets_gradients_under_replay(moe):
    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3)
    with_own = _router_grads(trainer, minibatch(prompts, responses, own))
    forced = _router_grads(trainer, minibatch(prompts, responses, other_routes(own)))
    assert all(g.abs().sum() > 0 for g in forced)
    plain = TorchTrainer(str(model_dir), policy=PolicySettings(micro_batch_size=2))
    plain.model.zero_grad(set_to_none=True)
    rows = minibatch(prompts, responses, None)
    Minibatch.of(rows, plain.policy).loss(plain._token_logprobs, slice(0, 3), plain.policy).total.backward()
    routers = [m for m in plain.model.modules() if type(m).__name__ == "Qwen3MoeTopKRouter"]
    for replayed, own_grad in zip(with_own, routers, strict=True):  # own routes: the model's own gradient
        torch.testing.assert_close(replayed, own_grad.weight.grad, rtol=1e-5, atol=1e-7)


def test_router_mismatch_is_zero_for_own_routes_and_counts_the_others(moe):
    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3)
    assert trainer.train_step([minibatch(prompts, responses, own)])["actor/router_mismatch"] == 0.0
    trainer = TorchTrainer(str(model_dir), policy=R3)
    assert trainer.train_step([minibatch(prompts, responses, other_routes(own))])["actor/router_mismatch"] == 1.0
    half = [own[0], *other_routes(own[1:])]  # the first sequence replays its own routes
    share = trainer.train_step([minibatch(prompts, responses, half)])["actor/router_mismatch"]
    others = _context_tokens(prompts[1:], responses[1:]) / _context_tokens(prompts, responses)
    assert 0 < share < 1 and share == pytest.approx(others, abs=0.15)  # one step of training may move a few
    off = TorchTrainer(str(model_dir), policy=PolicySettings(micro_batch_size=2))
    assert "actor/router_mismatch" not in off.train_step([minibatch(prompts, responses, None)])


def test_the_proximal_pass_replays_the_routes_too(moe):
    """Anchors recomputed under the same forced routes: the first update's ratio is exactly 1."""
    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3, compute_prox_log_prob=True)
    metrics = trainer.train_step([minibatch(prompts, responses, other_routes(own))])
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)


def test_a_minibatch_without_routes_is_one_clear_error():
    prompts, responses = batch()
    rows = minibatch(prompts, responses, None)
    del rows["routed_experts"]
    with pytest.raises(KeyError, match=r"routed_experts column.*3 of 3 rows.*enable_rollout_routing_replay"):
        Minibatch.of(rows, R3)
    with pytest.raises(KeyError, match=r"routed_experts column.*3 of 3 rows"):
        Minibatch.of(minibatch(prompts, responses, [None] * 3), R3)
    Minibatch.of(rows, PolicySettings())  # without replay the column is not needed
    short = [[[0, 1, 2, 3]] * (len(p) + len(r) - 2) for p, r in zip(prompts, responses, strict=True)]
    with pytest.raises(ValueError, match=r"row 0: routed_experts has \d+ rows for"):
        Minibatch.of(minibatch(prompts, responses, short), R3)


def test_routes_of_another_shape_or_a_dense_model_are_refused(moe, tmp_path):
    from pipeline.tasks.embedded import build_model

    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3)
    three_layers = [[token + token[:2] for token in row] for row in own]
    with pytest.raises(ValueError, match=r"6 expert ids per token, but the model has 2 MoE layers x top-2"):
        trainer._token_logprobs(prompts, responses, routes=pad_routes(prompts, responses, three_layers))
    build_model(tmp_path, vocab_size=291, seed=0)
    with pytest.raises(ValueError, match=r"has no MoE layers: set actor.router_replay.mode=disabled"):
        TorchTrainer(str(tmp_path), policy=R3)


def test_routes_are_padded_to_the_context_with_no_route():
    prompts, responses = [[1, 2], [3]], [[4, 5, 6], [7]]
    routes = [np.full((4, 4), 3, np.uint8), [[2, 1, 0, 3]]]  # numpy rows (as Arrow hands them) or lists
    padded = pad_routes(prompts, responses, routes)
    assert padded.shape == (2, 5, 4) and padded.dtype == torch.long
    assert (padded[0, :4] == 3).all() and (padded[0, 4] == NO_ROUTE).all()  # the last token has no route
    assert padded[1, 0].tolist() == [2, 1, 0, 3] and (padded[1, 1:] == NO_ROUTE).all()


def test_router_replay_keys_are_verls():
    assert load_config(None).actor.policy().router_replay.mode == "disabled"
    both = [
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    ]
    cfg = load_config(None, [*both, "model.arch=moe"])
    assert cfg.actor.policy().router_replay.active
    with pytest.raises(ConfigError, match=r"router_replay.mode=R3 .*set rollout.enable_rollout_routing_replay=true"):
        load_config(None, both[:1])
    with pytest.raises(ConfigError, match=r"mode='R2' is not supported.*'R3' replays the engine's routes"):
        load_config(None, ["actor.router_replay.mode=R2"])
    with pytest.raises(ConfigError, match=r"Did you mean 'mode'"):
        load_config(None, ["actor.router_replay.mod=R3"])
    with pytest.raises(ConfigError, match=r"record_file / replay_file are not supported"):
        load_config(None, ["actor.router_replay.record_file=/tmp/routes.pt"])


def test_route_row_versions_follow_the_prefill_and_the_decode():
    # keep mode: one request from version 3; its decode fed tokens sampled at 3, 3, 4, 5 (a sync froze it twice)
    assert route_row_versions(3, [3, 3, 4, 5], 3).tolist() == [3, 3, 3, 3, 4, 5]
    # abort mode: resumed at version 5, whose prefill recomputed every row of the context
    assert route_row_versions(3, [3, 3, 4, 5], 5).tolist() == [5] * 6
    # a log written before routes_version: each row the version of the token it predicts
    assert route_row_versions(2, [1, 2], None).tolist() == [1, 1, 2]
    assert route_row_versions(2, [], 4).tolist() == []


def test_stale_router_mismatch_counts_only_rows_older_weights_computed(moe):
    """Sample 0 replays its own routes, all computed at version 0; sample 1 other routes, computed at the
    trainer's version 1; sample 2 other routes from a keep-mode request that began at 0 and went on at 1."""
    model_dir, prompts, responses, own = moe
    trainer = TorchTrainer(str(model_dir), policy=R3)
    forced = other_routes(own)
    rows = minibatch(prompts, responses, [own[0], forced[1], forced[2]])
    t2 = len(responses[2])
    rows["token_param_version"] = [[0] * len(responses[0]), [1] * len(responses[1]), [0] + [1] * (t2 - 1)]
    rows["routes_version"] = [0, 1, 0]
    rows["trainer_version"] = [1, 1, 1]
    mb = Minibatch.of(rows, trainer.policy)
    micro = mb.loss(trainer._token_logprobs, slice(0, 3), trainer.policy)
    stale0 = len(prompts[0]) + len(responses[0]) - 1  # every row of sample 0
    stale2 = len(prompts[2])  # sample 2's prompt rows: the last one predicts its first token, sampled at 0
    assert micro.stale_replayed == 2 * (stale0 + stale2)  # 2 MoE layers
    assert micro.stale_changed == 2 * stale2  # sample 0's own routes agree with the trainer's router
    assert micro.routes_replayed == 2 * _context_tokens(prompts, responses)
    totals = StepTotals(trainer.policy)
    totals.add_micro(micro)
    metrics = totals.metrics()
    assert metrics["actor/router_mismatch_stale"] == pytest.approx(stale2 / (stale0 + stale2))
    rows["trainer_version"] = [0, 0, 0]  # nothing older than the trainer: no stale metric at all
    totals = StepTotals(trainer.policy)
    totals.add_micro(Minibatch.of(rows, trainer.policy).loss(trainer._token_logprobs, slice(0, 3), trainer.policy))
    assert "actor/router_mismatch_stale" not in totals.metrics()
