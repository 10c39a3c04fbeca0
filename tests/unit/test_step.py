"""The shared PPO step (stages/trainer/step.py) on a hand-written fake forward: micro-batches add up to the whole
mini-batch for every aggregation mode, the entropy bonus and the KL loss enter the objective as verl's actor adds
them, per-token advantages are used, and the metrics carry verl's names."""

import math

import numpy as np
import pytest
import torch

from stages.trainer.kl import kl_penalty
from stages.trainer.loss import TokenForward, entropy_from_logits
from stages.trainer.settings import PolicySettings
from stages.trainer.step import Minibatch, StepTotals

VOCAB = 7


class BigramForward:
    """A model small enough to reason about: the logits of each token are a row of W picked by the token before."""

    def __init__(self, seed: int = 0) -> None:
        self.w = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)).requires_grad_()

    def __call__(self, prompts: list, responses: list, entropy: bool = False) -> TokenForward:
        width = max(len(r) for r in responses)
        logp, mask, ent = torch.zeros(len(responses), width), torch.zeros(len(responses), width), None
        ent = torch.zeros(len(responses), width) if entropy else None
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            prev = torch.tensor([p[-1], *r[:-1]])
            logits = self.w[prev]  # (T_i, V)
            logp[i, : len(r)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
            mask[i, : len(r)] = 1.0
            if ent is not None:
                ent[i, : len(r)] = entropy_from_logits(logits)
        return TokenForward(logp, mask, ent)


def _rows(seed: int = 1) -> dict[str, list]:
    """Five responses of 1..5 tokens; the fourth fully masked (e.g. rejected), the others partly."""
    rng = np.random.default_rng(seed)
    responses = [rng.integers(0, VOCAB, n).tolist() for n in (3, 5, 1, 4, 2)]
    masks = [[1, 1, 0], [1, 0, 1, 1, 1], [1], [0, 0, 0, 0], [1, 1]]
    pairs = responses, masks
    return {
        "prompt_ids": [[int(rng.integers(0, VOCAB))] for _ in responses],
        "response_ids": responses,
        "response_mask": masks,
        "response_logprobs": [(rng.normal(size=len(r)) * 0.3 - 2.0).tolist() for r in responses],
        "ref_logprobs": [(rng.normal(size=len(r)) * 0.3 - 2.0).tolist() for r in responses],
        "token_advantages": [(rng.normal(size=len(r)) * np.asarray(m)).tolist() for r, m in zip(*pairs, strict=True)],
    }


def _grad(policy: PolicySettings, micro: int, rows: dict | None = None) -> tuple[torch.Tensor, StepTotals]:
    fwd, totals = BigramForward(), StepTotals(policy)
    mb = Minibatch.of(rows or _rows(), policy)
    for sl in mb.slices(micro):
        res = mb.loss(fwd, sl, policy)
        res.total.backward()
        totals.add_micro(res)
    totals.add_update(0.0)
    return fwd.w.grad, totals


@pytest.mark.parametrize(
    "mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
)
def test_micro_batch_gradients_add_up_to_the_mini_batch_gradient(mode):
    policy = PolicySettings(loss_agg_mode=mode, entropy_coeff=0.01, use_kl_loss=True, clip_ratio=0.1)
    whole, whole_totals = _grad(policy, micro=5)
    for micro in (1, 2):
        accumulated, totals = _grad(policy, micro=micro)
        assert torch.allclose(accumulated, whole, atol=1e-6), (mode, micro)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
            assert totals.metrics()[key] == pytest.approx(whole_totals.metrics()[key], rel=1e-6, abs=1e-6), (mode, key)


def test_the_aggregation_counts_span_the_mini_batch():
    mb = Minibatch.of(_rows(), PolicySettings())
    # 9 trained tokens; 5 rows, the fully masked one included; null loss_scale_factor: the padded width, 5
    assert (mb.counts.tokens, mb.counts.sequences, mb.counts.scale_factor) == (9.0, 5.0, 5.0)
    assert Minibatch.of(_rows(), PolicySettings(loss_scale_factor=48)).counts.scale_factor == 48.0


def test_the_entropy_bonus_changes_the_loss_by_exactly_coeff_times_entropy():
    rows, fwd = _rows(), BigramForward()
    plain = Minibatch.of(rows, PolicySettings()).loss(fwd, slice(0, 5), PolicySettings())
    policy = PolicySettings(entropy_coeff=0.05)
    bonus = Minibatch.of(rows, policy).loss(fwd, slice(0, 5), policy)
    assert bonus.entropy == pytest.approx(plain.entropy) and plain.entropy > 0
    assert bonus.total.item() == pytest.approx(plain.total.item() - 0.05 * plain.entropy, abs=1e-7)
    # the logged entropy is the token-mean of the per-token entropies over the 9 trained tokens
    out = fwd(rows["prompt_ids"], rows["response_ids"], entropy=True)
    mask = torch.zeros_like(out.entropy)
    for i, m in enumerate(rows["response_mask"]):
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.float32)
    assert plain.entropy == pytest.approx(float((out.entropy.detach() * mask).sum() / 9), rel=1e-6)


def test_the_kl_loss_changes_the_gradient_and_is_logged():
    off, off_totals = _grad(PolicySettings(), micro=5)
    on, on_totals = _grad(PolicySettings(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="low_var_kl"), micro=5)
    assert not torch.allclose(on, off)
    # The difference is exactly 0.5 * d/dW of the token-mean of k3(logp, ref) over the trained tokens.
    rows, fwd = _rows(), BigramForward()
    out = fwd(rows["prompt_ids"], rows["response_ids"])
    ref, mask = torch.zeros_like(out.logp), torch.zeros_like(out.logp)
    for i, (r, m) in enumerate(zip(rows["ref_logprobs"], rows["response_mask"], strict=True)):
        ref[i, : len(r)], mask[i, : len(m)] = torch.tensor(r), torch.tensor(m, dtype=torch.float32)
    k3 = (kl_penalty(out.logp, ref, "low_var_kl") * mask).sum() / 9
    k3.backward()
    assert torch.allclose(on - off, 0.5 * fwd.w.grad, atol=1e-6)
    m = on_totals.metrics()
    assert m["actor/kl_loss"] == pytest.approx(k3.item(), rel=1e-5) and m["actor/kl_coef"] == 0.5
    assert off_totals.metrics()["actor/kl_loss"] == 0.0 and "actor/kl_coef" not in off_totals.metrics()


def test_the_kl_loss_needs_the_reference_logprobs():
    rows = _rows()
    del rows["ref_logprobs"]
    with pytest.raises(KeyError, match=r"ref_logprobs column.*5 of 5 rows.*stages.ref_logprob.RefLogprob"):
        Minibatch.of(rows, PolicySettings(use_kl_loss=True))
    rows["ref_logprobs"] = [[0.0] * len(r) for r in rows["response_ids"]]
    rows["ref_logprobs"][2] = None  # what SampleLog writes when no stage added the column
    with pytest.raises(KeyError, match=r"1 of 5 rows"):
        Minibatch.of(rows, PolicySettings(use_kl_loss=True))
    Minibatch.of(rows, PolicySettings())  # without the KL loss the column is not needed


def test_per_token_advantages_are_used_and_a_scalar_one_is_broadcast():
    rows, policy, fwd = _rows(), PolicySettings(), BigramForward()
    rows["token_advantages"] = [[2.0, 0.0, 0.0], [1.0, 0.0, 3.0, 0.0, 0.0], [0.0], [0.0] * 4, [0.0, 0.0]]
    res = Minibatch.of(rows, policy).loss(fwd, slice(0, 5), policy)
    # a trained token's loss is -A * r: each token's own advantage counts, and only on trained tokens
    for i, t, counts in ((1, 2, True), (0, 0, True), (0, 2, False)):  # row 0's third token is masked
        moved = rows | {"token_advantages": [list(a) for a in rows["token_advantages"]]}
        moved["token_advantages"][i][t] += 5.0
        other = Minibatch.of(moved, policy).loss(fwd, slice(0, 5), policy)
        assert (other.total.item() != pytest.approx(res.total.item())) == counts, (i, t)
    scalar = {k: v for k, v in rows.items() if k != "token_advantages"} | {"advantage": [1.0, -1.0, 0.5, 2.0, 0.0]}
    broadcast = Minibatch.of(scalar, policy).loss(fwd, slice(0, 5), policy)
    spread = [[a] * len(r) for a, r in zip(scalar["advantage"], rows["response_ids"], strict=True)]
    per_token = rows | {"token_advantages": spread}
    explicit = Minibatch.of(per_token, policy).loss(fwd, slice(0, 5), policy)
    assert broadcast.total.item() == pytest.approx(explicit.total.item())
    with pytest.raises(KeyError, match=r"token_advantages \(or advantage\)"):
        Minibatch.of({k: v for k, v in rows.items() if k != "token_advantages"}, policy)


def test_step_metrics_have_verls_names():
    _, totals = _grad(PolicySettings(), micro=2)
    m = totals.metrics()
    assert {
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/pg_clipfrac_lower",
        "actor/ppo_kl",
        "actor/entropy",
        "actor/kl_loss",
        "actor/grad_norm",
        "train/num_tokens",
        "timing/train_s",
    } <= set(m)
    assert m["train/num_tokens"] == 9.0 and all(math.isfinite(v) for v in m.values())
