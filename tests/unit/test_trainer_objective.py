"""TorchTrainer trains verl's actor objective on the tiny embedded model: per-token advantages, the entropy bonus
and the KL loss reach its metrics under verl's names, and a KL loss without reference logprobs is refused."""

import numpy as np
import pytest
import torch

from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import PolicySettings
from stages.trainer.torch_backend import TorchTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_embedded(tmp_path_factory.mktemp("objective"), num_prompts=8, seed=0).model_dir)


def _minibatch(trainer: TorchTrainer, ref_shift: float | None) -> dict[str, list]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 200, size=6).tolist() for _ in range(4)]
    responses = [rng.integers(10, 200, size=int(n)).tolist() for n in (3, 5, 4, 6)]
    current = trainer.logprobs(prompts, responses)
    rows = {
        "prompt_ids": prompts,
        "response_ids": responses,
        "response_logprobs": current,
        "response_mask": [[1] * len(r) for r in responses],
        "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
    }
    if ref_shift is not None:
        rows["ref_logprobs"] = [[x + ref_shift for x in row] for row in current]
    return rows


def test_the_kl_loss_and_the_entropy_are_logged(model_dir):
    policy = PolicySettings(lr=1e-3, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
    trainer = TorchTrainer(model_dir, policy)
    m = trainer.train_step([_minibatch(trainer, ref_shift=-0.5)])
    # The update starts from the behaviour weights: ratio 1, nothing clipped. ref = logp - 0.5 on every token:
    # k3 = exp(-0.5) + 0.5 - 1 per token, so its token mean is that too.
    assert m["actor/kl_loss"] == pytest.approx(np.exp(-0.5) - 0.5, rel=1e-4)
    assert m["actor/kl_coef"] == 0.1
    assert m["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6) and m["actor/pg_clipfrac"] == 0.0
    assert 0.0 < m["actor/entropy"] < np.log(trainer.model.config.vocab_size) and m["actor/grad_norm"] > 0


def test_a_kl_loss_without_reference_logprobs_is_refused(model_dir):
    trainer = TorchTrainer(model_dir, PolicySettings(use_kl_loss=True))
    with pytest.raises(KeyError, match="stages.ref_logprob.RefLogprob"):
        trainer.train_step([_minibatch(trainer, ref_shift=None)])


def test_the_learning_rate_follows_the_schedule_and_is_logged(model_dir):
    from stages.trainer.lr_schedule import OptimSettings

    optim = OptimSettings(lr_warmup_steps=2, total_training_steps=10)
    trainer = TorchTrainer(model_dir, PolicySettings(lr=1e-3, optim=optim))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    first = trainer.train_step([_minibatch(trainer, ref_shift=None)])
    # verl's warmup starts at rate 0: the first update leaves the weights where they were
    assert first["actor/lr"] == 0.0
    assert all(torch.equal(p, start[n]) for n, p in trainer.model.named_parameters())
    rates = [trainer.train_step([_minibatch(trainer, ref_shift=None)])["actor/lr"] for _ in range(2)]
    assert rates == pytest.approx([5e-4, 1e-3])


@pytest.mark.parametrize("mode", ["gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "dppo_kl", "gpg"])
def test_each_loss_mode_trains_the_model(model_dir, mode):
    policy = PolicySettings(lr=1e-3)
    policy.policy_loss.loss_mode = mode
    trainer = TorchTrainer(model_dir, policy)
    m = trainer.train_step([_minibatch(trainer, ref_shift=None)])
    assert m["actor/grad_norm"] > 0 and np.isfinite(m["actor/pg_loss"])
