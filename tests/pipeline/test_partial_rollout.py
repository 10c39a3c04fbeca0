"""Partial rollout: a sync in the middle of long responses; every token's version, and the logprobs around the switch.

Long fixed-length responses (ignore_eos) are in flight when the trainer pushes changed weights (three times, the
same weights, each once the engine is decoding responses again, so that every push lands mid-flight). In `abort` mode
the tokens after the switch were sampled by the new weights over a recomputed prefix, so their logprobs equal the
trainer's (which now holds the new weights) within the stated 1e-4. In both modes the tokens before the switch
equal the old weights' logprobs (a second trainer keeps version 0). In `keep` mode the engine continues over the
KV cache the old weights computed (PipelineRL), so after the switch the logprobs equal neither policy: the test
checks they are nearer the new one on average.

One engine (tens of seconds to start) serves both modes: `abort` first, then, switched to `keep`, a second trained
step pushed the same way. A mirror trainer, given the same first step, keeps its weights for the `keep` phase's
"old" policy. The same engine then shows that pushed weights really reach it (engine_checks.py): its logprobs equal
the trainer's after a push of a changed model, and are uniform after a push of a zeroed head.
"""

import numpy as np
import pytest

from pipeline import sync
from pipeline.clock import VersionClock
from pipeline.tasks.embedded import build_embedded
from stages.engines.base import PauseMode
from stages.generate import VLLMGenerate
from stages.staleness import StalenessBudget
from stages.trainer.settings import PolicySettings
from stages.trainer.torch_backend import TorchTrainer
from tests.pipeline.engine_checks import (
    TOL,
    check_pushes_reach_the_engine,
    check_the_model_runs_in_the_engine_core,
    prompts,
    wait_until_decoding,
)

MAX_TOKENS = 240


def check_phase(ray, out, base: int, mode: str, new_policy, old_policy) -> None:
    """Every token's version in order, none lost; the responses in flight at the first push (their first token at
    version `base`) hold the old policy's logprobs before the switch and, after it, the new policy's (`abort`) or
    nearer the new than the old (`keep`)."""
    versions = out["token_param_version"].to_pylist()
    assert all(len(v) == MAX_TOKENS for v in versions)  # no token lost, none generated twice
    assert all(a <= b for v in versions for a, b in zip(v, v[1:], strict=False))
    spanning = [i for i, v in enumerate(versions) if v[0] == base and v[-1] > base]
    assert spanning, f"{mode}: no response was in flight at a sync"
    if mode == "abort":
        assert all(out["num_resumes"][i].as_py() == len(set(versions[i])) - 1 for i in spanning)

    ids = (out["prompt_ids"].to_pylist(), out["response_ids"].to_pylist())
    new, old = ray.get([new_policy.logprobs.remote(*ids), old_policy.logprobs.remote(*ids)])
    before_old, after_new, after_old = [], [], []
    for i in spanning:
        engine_lp = np.asarray(out["response_logprobs"][i].as_py())
        switch = next(j for j, v in enumerate(versions[i]) if v > base)
        before_old.append(np.abs(engine_lp[:switch] - np.asarray(old[i][:switch])).max())
        after_new.append(np.abs(engine_lp[switch:] - np.asarray(new[i][switch:])))
        after_old.append(np.abs(engine_lp[switch:] - np.asarray(old[i][switch:])))
    assert max(before_old) < TOL, mode  # tokens before the switch: exactly the old weights, in both modes
    if mode == "abort":
        assert max(d.max() for d in after_new) < TOL  # after it: exactly the new weights (prefix recomputed)
    else:  # new weights over the old weights' KV cache: nearer the new policy than the old, not equal to either
        assert np.mean(np.concatenate(after_new)) < np.mean(np.concatenate(after_old))


@pytest.mark.slow
def test_sync_mid_response_in_abort_then_keep_mode(ray_session, tmp_path):
    ray = ray_session
    from transformers import AutoTokenizer

    task = build_embedded(tmp_path, 20, seed=2)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    ns = "partial"
    clock = (
        ray.remote(VersionClock)
        .options(name="clock", namespace=ns, num_cpus=0, max_concurrency=100)
        .remote(StalenessBudget(0.5, 1, 1, 2), 1)
    )

    def policy(lr: float, cpus: float):
        return ray.remote(TorchTrainer).options(num_cpus=cpus).remote(str(task.model_dir), PolicySettings(lr=lr))

    trainer, first, mirror = policy(5e-2, 1), policy(0.0, 0), policy(5e-2, 0)  # first: version 0 throughout
    engine = (
        ray.remote(VLLMGenerate)
        .options(num_cpus=1)
        .remote(str(task.model_dir), "clock", ns, n=16, max_tokens=MAX_TOKENS, pause_mode="abort", ignore_eos=True)
    )
    batch = prompts(tokenizer, ["reverse: a b c =", "reverse: d e =", "reverse: f g h i =", "reverse: j k ="])
    pusher = sync.Push(trainer, clock, 1, tmp_path)
    pusher.connect()

    def train_step(*policies) -> None:  # a real update, so that each phase's pushes change the weights
        short = ray.get(engine.__call__.remote(batch.slice(0, 1)))
        advantages = np.random.default_rng(0).choice([-1.0, 1.0], short.num_rows).tolist()
        ray.get([p.train_step.remote([{**short.to_pydict(), "advantage": advantages}]) for p in policies])

    def generate_across_syncs(versions: tuple[int, ...]):
        pending = engine.__call__.remote(batch)  # 64 long responses: seconds of generation on 2 cores
        for version in versions:  # the same new weights each time, each while responses are being decoded
            wait_until_decoding(ray, engine, pending)
            pusher.sync(version)
        return ray.get(pending)

    train_step(trainer, mirror)  # the mirror holds version 1's weights from here on
    check_the_model_runs_in_the_engine_core(ray, engine)
    ids = (batch["prompt_ids"].to_pylist(), [[5, 6, 7]] * batch.num_rows)
    assert np.allclose(*ray.get([trainer.logprobs.remote(*ids), mirror.logprobs.remote(*ids)]), atol=1e-6)
    check_phase(ray, generate_across_syncs((1, 2, 3)), 0, "abort", trainer, first)

    ray.get(engine.__ray_call__.remote(lambda gen: setattr(gen.replica, "pause_mode", PauseMode.KEEP)))
    train_step(trainer)
    check_phase(ray, generate_across_syncs((4, 5, 6)), 3, "keep", trainer, mirror)

    check_pushes_reach_the_engine(ray, engine, trainer, pusher, batch.slice(0, 1), len(tokenizer), 6)
    ray.kill(engine)
