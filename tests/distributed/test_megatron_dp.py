"""Data parallelism changes nothing but the layout for the Megatron backend: DP = 2 (two model replicas over gloo on
127.0.0.1, rank 0 a Ray actor starting its peers, as in a run) trains with DP = 1's losses, its checkpoint resumes
at DP = 2, and TP x DP = 2 x 2 exports the HF tensors TP = 1 exports and trains with its losses.

Two steps of two mini-batches (5 and 6 rows, so a replica gets one row more than the other), with proximal
logprobs (each replica computes its share's), the entropy bonus and the KL loss. Tolerance against DP = 1 on every
metric: 1e-5 relative or 1e-6 absolute, whichever is larger (the replicas sum in another order and pad their
micro-batches to other widths). Weights after a step: within 2e-5 absolute, a hundredth of the step's largest move
(two AdamW updates at lr 1e-3), but at a few elements whose gradient rounds near zero (adam_weights.py).
"""

import numpy as np
import pytest

from stages.trainer.megatron_backend import MegatronTrainer
from stages.trainer.settings import PolicySettings
from tests.distributed.adam_weights import assert_trained_alike

POLICY = PolicySettings(lr=1e-3, micro_batch_size=2, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
RTOL, ATOL, WEIGHT_ATOL = 1e-5, 1e-6, 2e-5


def _minibatches(trainer) -> list[dict[str, list]]:
    import ray

    rng = np.random.default_rng(0)
    out = []
    for n in (5, 6):
        prompts = [rng.integers(10, 200, int(rng.integers(3, 9))).tolist() for _ in range(n)]
        responses = [rng.integers(10, 200, int(rng.integers(1, 12))).tolist() for _ in range(n)]
        current = ray.get(trainer.logprobs.remote(prompts, responses))
        out.append(
            {
                "prompt_ids": prompts,
                "response_ids": responses,
                "response_mask": [[1] * len(r) for r in responses],
                # behaviour logprobs off the trainer's: ratios off 1, some clipped
                "response_logprobs": [(np.asarray(row) + rng.normal(0, 0.3, len(row))).tolist() for row in current],
                "ref_logprobs": [(np.asarray(row) - 0.2).tolist() for row in current],
                "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
            }
        )
    return out


def _published(ray, trainer, path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    ray.get(trainer.publish_weights.remote(str(path)))
    return load_file(str(path))


def _assert_same_metrics(got: dict, want: dict, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert set(got) == set(want)
    for key in sorted(want):
        if not key.startswith("timing/"):
            assert got[key] == pytest.approx(want[key], rel=rtol, abs=atol), key


def _assert_same_weights(got: dict, want: dict, exact: bool = False, steps: int = 1) -> None:
    """Bit for bit (`exact`: loaded, not trained), else as two layouts' AdamW updates over `steps` steps of two
    mini-batches agree (adam_weights.py)."""
    if exact:
        assert set(got) == set(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    else:
        assert_trained_alike(got, want, WEIGHT_ATOL, POLICY.lr, updates=2 * steps)


def test_dp2_and_tp2_dp2_train_with_dp1s_losses_and_a_dp2_checkpoint_resumes(ray_session, megatron_one_rank, tmp_path):
    ray, base = ray_session, megatron_one_rank
    remote = ray.remote(MegatronTrainer).options(num_cpus=0)

    def trainer(tp: int = 1, dp: int = 1, model: str = base.model_dir, optimizer_state: str | None = None):
        return remote.remote(
            model,
            policy=POLICY,
            compute_prox_log_prob=True,
            tensor_model_parallel_size=tp,
            data_parallel_size=dp,
            optimizer_state=optimizer_state,
        )

    # DP = 1 (the session's baseline, conftest.py): two steps, its weights before and after.
    batch, start, meta, first, second, end = base.batch, base.start, base.meta, base.first, base.second, base.end
    assert first["actor/pg_loss"] != second["actor/pg_loss"]  # the step changed the weights

    two = trainer(dp=2)
    prompts = [r for mb in batch for r in mb["prompt_ids"]]
    responses = [r for mb in batch for r in mb["response_ids"]]
    assert ray.get(two.weight_meta.remote()) == meta
    got = ray.get(two.logprobs.remote(prompts, responses))  # each replica its share, back in the rows' order
    want = [r for mb in batch for r in (np.asarray(x) + 0.2 for x in mb["ref_logprobs"])]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    _assert_same_metrics(ray.get(two.train_step.remote(batch)), first)
    after_first = _published(ray, two, tmp_path / "two.safetensors")
    ray.get(two.save_checkpoint.remote(str(tmp_path / "ckpt")))
    ray.kill(two)  # its peer ends with it

    resumed = trainer(dp=2, model=str(tmp_path / "ckpt" / "model"), optimizer_state=str(tmp_path / "ckpt/optimizer.pt"))
    _assert_same_weights(_published(ray, resumed, tmp_path / "resumed.safetensors"), after_first, exact=True)
    _assert_same_metrics(ray.get(resumed.train_step.remote(batch)), second)  # AdamW's moments came back too
    _assert_same_weights(_published(ray, resumed, tmp_path / "resumed_end.safetensors"), end, steps=2)
    ray.kill(resumed)

    grid = trainer(tp=2, dp=2)
    assert ray.get(grid.weight_meta.remote()) == meta  # full shapes, the same names and order
    _assert_same_weights(_published(ray, grid, tmp_path / "grid_start.safetensors"), start, exact=True)
    _assert_same_metrics(ray.get(grid.train_step.remote(batch)), first)
    _assert_same_weights(_published(ray, grid, tmp_path / "grid.safetensors"), after_first)
    ray.kill(grid)
