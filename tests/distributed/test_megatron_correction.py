"""The Megatron backend applies rollout correction as the torch backend does, in both of verl's modes: decoupled
(proximal logprobs for the whole step before the first update, the step corrected at once) and bypass (the
bypass_mode loss corrects against the engine's logprobs inside the loss); and, decoupled, each subtracts the optimal
token baseline from the rows' returns the same way (its sum pi^2 from each backend's proximal pass).

Each backend trains the same two mini-batches of one step from the embedded model in a process of its own (Megatron
on gloo, TP = 1; spawn), behaviour logprobs pushed off the trainer's so that weights and rejection both bite.
Tolerance 1e-4 relative or 1e-5 absolute: Megatron's GPT and transformers' Qwen2 compute the same logprobs up to
float32 rounding, and a rejection threshold sits well away from every ratio of the batch.
"""

import numpy as np
import pytest
import torch.multiprocessing as mp

from pipeline.tasks.embedded import build_embedded
from stages.trainer.settings import CorrectionSettings, PolicySettings

RTOL, ATOL = 1e-4, 1e-5
CORRECTION = CorrectionSettings(rollout_is="token", rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6")


def _minibatches(model_dir: str) -> list[dict[str, list]]:
    from stages.trainer.torch_backend import TorchTrainer

    trainer = TorchTrainer(model_dir, PolicySettings())
    rng = np.random.default_rng(0)
    out = []
    for n in (4, 5):
        prompts = [rng.integers(10, 200, int(rng.integers(3, 9))).tolist() for _ in range(n)]
        responses = [rng.integers(10, 200, int(rng.integers(2, 10))).tolist() for _ in range(n)]
        current = trainer.logprobs(prompts, responses)
        out.append(
            {
                "prompt_ids": prompts,
                "response_ids": responses,
                "response_mask": [[1] * len(r) for r in responses],
                "response_logprobs": [
                    (np.asarray(row) + rng.choice([-0.05, 0.1, 1.0], len(row))).tolist() for row in current
                ],
                "token_advantages": [rng.normal(size=len(r)).tolist() for r in responses],
                "prompt_id": [f"{n}-{i // 2}" for i in range(n)],  # groups of 2 (the optimal token baseline's)
            }
        )
    return out


def _train(backend: str, model_dir: str, mode: str, queue) -> None:
    bypass = mode == "bypass"
    policy = PolicySettings(lr=1e-3, micro_batch_size=3, trainer_baseline="otb" if mode == "otb" else "")
    policy.policy_loss.loss_mode = "bypass_mode" if bypass else "vanilla"
    kwargs = dict(policy=policy, compute_prox_log_prob=not bypass, rollout_correction=CORRECTION)
    if backend == "megatron":
        from stages.trainer.megatron_backend import MegatronTrainer

        trainer = MegatronTrainer(model_dir, **kwargs)
    else:
        from stages.trainer.torch_backend import TorchTrainer

        trainer = TorchTrainer(model_dir, **kwargs)
    queue.put(trainer.train_step(_minibatches(model_dir)))


def _run(backend: str, model_dir: str, mode: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_train, args=(backend, model_dir, mode, queue))
    proc.start()
    result = queue.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(build_embedded(tmp_path_factory.mktemp("megatron_corr"), 8, seed=2).model_dir)


@pytest.mark.parametrize("mode", ["decoupled", "bypass", "otb"])
def test_megatron_corrects_as_the_torch_trainer(model_dir, mode):
    """'otb': decoupled, with the optimal token baseline subtracted from the rows' returns by each backend."""
    torch_m, megatron_m = _run("torch", model_dir, mode), _run("megatron", model_dir, mode)
    corr = sorted(k for k in torch_m if k.startswith("rollout_corr/"))
    assert "rollout_corr/rollout_rs_masked_fraction" in corr and "rollout_corr/rollout_is_mean" in corr
    assert 0.0 < torch_m["rollout_corr/rollout_rs_masked_fraction"] < 1.0  # the rejection bites, not all of it
    assert corr == sorted(k for k in megatron_m if k.startswith("rollout_corr/"))
    for key in [*corr, "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "train/num_tokens"]:
        assert megatron_m[key] == pytest.approx(torch_m[key], rel=RTOL, abs=ATOL), key
