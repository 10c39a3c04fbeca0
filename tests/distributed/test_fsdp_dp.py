"""Data parallelism changes nothing but the layout: the torch trainer at fsdp_size=2 (FSDP2 over gloo on 127.0.0.1,
rank 0 a Ray actor starting its peer, as in a run) trains with fsdp_size=1's losses, and its checkpoint resumes.
`set_weight` reaches both ranks' shards.

One step of two mini-batches (5 and 6 rows: the 5-row one leaves a rank a micro-batch short, so it runs an idle
pass) with proximal logprobs (each rank computes its share's), rollout correction, the entropy bonus and the KL
loss. Tolerance against DP = 1 on every metric: 1e-5 relative or 1e-6 absolute, whichever is larger. The ranks sum
in another order and pad their micro-batches to other widths, so float32 rounding differs: seen up to 2e-7
relative, and 1.6e-7 absolute on pg_loss, a sum of signed O(1) per-token terms that nearly cancel. Weights after
the step: within 2e-5 absolute (seen: about 4e-6), a hundredth of the step's largest move (2e-3, two AdamW updates
at lr 1e-3), but at a few elements whose gradient rounds near zero (adam_weights.py). A DP = 2 checkpoint resumes
bit for bit at DP = 2 and, being the single-process layout, at DP = 1 within the metric tolerance.
"""

import dataclasses

import numpy as np
import pytest

from pipeline.tasks.embedded import build_embedded
from stages.trainer.micro_batches import MicroBatching
from stages.trainer.settings import CorrectionSettings, ExecutionSettings, PolicySettings
from stages.trainer.torch_backend import TorchTrainer
from tests.distributed.adam_weights import assert_trained_alike

POLICY = PolicySettings(lr=1e-3, micro_batch_size=2, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
ARGS = dict(compute_prox_log_prob=True, rollout_correction=CorrectionSettings(rollout_is="token"))
RTOL, ATOL, WEIGHT_ATOL = 1e-5, 1e-6, 2e-5


def _minibatches(trainer: TorchTrainer) -> list[dict[str, list]]:
    rng = np.random.default_rng(0)
    out = []
    for n in (5, 6):
        prompts = [rng.integers(10, 200, int(rng.integers(3, 9))).tolist() for _ in range(n)]
        responses = [rng.integers(10, 200, int(rng.integers(1, 12))).tolist() for _ in range(n)]
        current = trainer.logprobs(prompts, responses)
        out.append(
            {
                "prompt_ids": prompts,
                "response_ids": responses,
                "response_mask": [[1] * len(r) for r in responses],
                # behaviour logprobs off the trainer's: ratios off 1, some clipped, corrections not 1
                "response_logprobs": [(np.asarray(row) + rng.normal(0, 0.3, len(row))).tolist() for row in current],
                "ref_logprobs": [(np.asarray(row) - 0.2).tolist() for row in current],
                "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
                "prompt_id": [f"{n}-{i // 2}" for i in range(n)],  # groups of 2 (the optimal token baseline's)
            }
        )
    return out


def _weights(trainer) -> dict[str, np.ndarray]:
    return {name: t.numpy().copy() for name, t in trainer.export()}


def _published(ray, trainer, path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    ray.get(trainer.publish_weights.remote(str(path)))
    return load_file(str(path))


def _assert_same_metrics(got: dict, want: dict, rtol: float, atol: float) -> None:
    assert set(got) == set(want)
    for key in sorted(want):
        if not key.startswith("timing/"):
            assert got[key] == pytest.approx(want[key], rel=rtol, abs=atol), key


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_embedded(tmp_path_factory.mktemp("fsdp"), 8, seed=5).model_dir)


def test_dp2_trains_with_dp1s_losses_and_its_checkpoint_resumes(ray_session, model_dir, tmp_path):
    from stages.trainer.fsdp_backend import FSDPTrainer

    ray = ray_session
    one = TorchTrainer(model_dir, POLICY, **ARGS)
    start, batch = _weights(one), _minibatches(one)
    want = one.train_step(batch)
    want_weights = _weights(one)

    remote = ray.remote(FSDPTrainer).options(num_cpus=0)
    two = remote.remote(model_dir, POLICY, fsdp_size=2, **ARGS)
    assert ray.get(two.weight_meta.remote()) == one.weight_meta()  # full shapes, the same names and order
    got = ray.get(two.train_step.remote(batch))
    print({k: (want[k], got[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss")})
    _assert_same_metrics(got, want, RTOL, ATOL)
    assert want["actor/pg_clipfrac"] > 0 and want["actor/kl_loss"] > 0  # the terms compared are not trivially 0
    got_weights = _published(ray, two, tmp_path / "dp2.safetensors")
    for name, value in want_weights.items():
        moved = np.abs(value - start[name]).max()
        assert moved > 0 or "norm" in name, name
    assert_trained_alike(got_weights, want_weights, WEIGHT_ATOL, POLICY.lr, updates=2)

    # Checkpoint at DP = 2, then the next step three ways: continuing, resumed at DP = 2, resumed at DP = 1.
    ray.get(two.save_checkpoint.remote(str(tmp_path / "ckpt")))
    cont = ray.get(two.train_step.remote(batch))
    cont_weights = _published(ray, two, tmp_path / "cont.safetensors")
    ray.kill(two)  # its peer ends with it
    resumed = remote.remote(
        str(tmp_path / "ckpt" / "model"),
        POLICY,
        fsdp_size=2,
        optimizer_state=str(tmp_path / "ckpt/optimizer.pt"),
        **ARGS,
    )
    _assert_same_metrics(ray.get(resumed.train_step.remote(batch)), cont, 0, 0)
    for name, value in _published(ray, resumed, tmp_path / "resumed.safetensors").items():
        np.testing.assert_array_equal(value, cont_weights[name], err_msg=name)
    ray.get(resumed.set_weight.remote("model.layers.0.mlp.down_proj.weight", 0.25))  # every rank fills its shard
    filled = _published(ray, resumed, tmp_path / "filled.safetensors")
    assert (filled["model.layers.0.mlp.down_proj.weight"] == 0.25).all()
    assert not (filled["model.layers.0.mlp.up_proj.weight"] == 0.25).any()
    ray.kill(resumed)
    single = TorchTrainer(
        str(tmp_path / "ckpt/model"), POLICY, optimizer_state=str(tmp_path / "ckpt/optimizer.pt"), **ARGS
    )
    _assert_same_metrics(single.train_step(batch), cont, RTOL, ATOL)


@pytest.mark.parametrize("baseline", ["", "otb"])
def test_dp2_packed_with_token_budgets_and_checkpointing_trains_what_dp1_padded_trains(
    ray_session, model_dir, tmp_path, baseline
):
    """The same step at fsdp_size=2 with every rank packing its micro-batches, cutting them by a token budget (the
    ranks' shares need different numbers of micro-batches: the shorter one cuts into more, as verl) and checkpointing
    its layers, the proximal pass cut by a budget too: DP = 1's padded metrics and weights, same tolerances. With
    the optimal token baseline ('otb') each rank's proximal pass also returns its share's sum pi^2, and the
    baseline over the whole mini-batch is DP = 1's."""
    from stages.trainer.fsdp_backend import FSDPTrainer

    ray = ray_session
    policy = dataclasses.replace(POLICY, trainer_baseline=baseline)
    one = TorchTrainer(model_dir, policy, **ARGS)
    batch = _minibatches(one)
    want = one.train_step(batch)
    budget = dataclasses.replace(policy, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=24)
    run = ExecutionSettings(
        use_remove_padding=True,
        enable_gradient_checkpointing=True,
        log_prob=MicroBatching(2, use_dynamic_bsz=True, max_token_len=30),
    )
    two = ray.remote(FSDPTrainer).options(num_cpus=0).remote(model_dir, budget, fsdp_size=2, execution=run, **ARGS)
    got = ray.get(two.train_step.remote(batch))
    _assert_same_metrics(got, want, RTOL, ATOL)
    got_weights = _published(ray, two, tmp_path / "packed.safetensors")
    assert_trained_alike(got_weights, _weights(one), WEIGHT_ATOL, POLICY.lr, updates=2)
    ray.kill(two)
