"""Partial rollout: a sync in the middle of long responses; every token's version, and the logprobs around the switch.

Long fixed-length responses (ignore_eos) are in flight when the trainer pushes changed weights (three times, the
same weights, each once the engine is decoding responses again, so that every push lands mid-flight). In `abort` mode
the tokens after the switch were sampled by the new weights over a recomputed prefix, so their logprobs equal the
trainer's (which now holds the new weights) within the stated 1e-4. In both modes the tokens before the switch
equal the old weights' logprobs (a second trainer keeps version 0). In `keep` mode the engine continues over the
KV cache the old weights computed (PipelineRL), so after the switch the logprobs equal neither policy: the test
checks they are nearer the new one on average.
"""

import numpy as np
import pytest

from pipeline import sync
from pipeline.clock import VersionClock
from pipeline.tasks.embedded import build_embedded
from stages.generate import VLLMGenerate
from stages.staleness import StalenessBudget
from stages.trainer.settings import PolicySettings
from stages.trainer.torch_backend import TorchTrainer
from tests.pipeline.test_weight_sync import TOL, prompts, wait_until_decoding


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["abort", "keep"])
def test_sync_mid_response(ray_session, tmp_path, mode):
    ray = ray_session
    from transformers import AutoTokenizer

    task = build_embedded(tmp_path, 20, seed=2)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    ns = f"partial-{mode}"
    clock = (
        ray.remote(VersionClock)
        .options(name="clock", namespace=ns, num_cpus=0, max_concurrency=100)
        .remote(StalenessBudget(0.5, 1, 1, 2), 1)
    )
    trainer = ray.remote(TorchTrainer).options(num_cpus=1).remote(str(task.model_dir), PolicySettings(lr=5e-2))
    old_policy = (
        ray.remote(TorchTrainer).options(num_cpus=0).remote(str(task.model_dir), PolicySettings(lr=0.0))
    )  # version 0
    engine = (
        ray.remote(VLLMGenerate)
        .options(num_cpus=1)
        .remote(str(task.model_dir), "clock", ns, n=16, max_tokens=240, pause_mode=mode, ignore_eos=True)
    )
    batch = prompts(tokenizer, ["reverse: a b c =", "reverse: d e =", "reverse: f g h i =", "reverse: j k ="])
    pusher = sync.Push(trainer, clock, 1, tmp_path)
    pusher.connect()
    short = ray.get(engine.__call__.remote(batch.slice(0, 1)))  # a real update so that the weights differ
    mb = {**short.to_pydict(), "advantage": np.random.default_rng(0).choice([-1.0, 1.0], short.num_rows).tolist()}
    ray.get(trainer.train_step.remote([mb]))

    pending = engine.__call__.remote(batch)  # 64 responses x 240 tokens: seconds of generation on 2 cores
    for version in (1, 2, 3):  # the same new weights three times, each while responses are being decoded
        wait_until_decoding(ray, engine, pending)
        pusher.sync(version)
    out = ray.get(pending)

    versions = out["token_param_version"].to_pylist()
    assert all(len(v) == 240 for v in versions)  # no token lost, none generated twice
    assert all(a <= b for v in versions for a, b in zip(v, v[1:], strict=False))
    spanning = [i for i, v in enumerate(versions) if v[0] == 0 and v[-1] >= 1]
    assert spanning, "no response was in flight at a sync"
    if mode == "abort":
        assert all(out["num_resumes"][i].as_py() == len(set(versions[i])) - 1 for i in spanning)

    ids = (out["prompt_ids"].to_pylist(), out["response_ids"].to_pylist())
    new, old = ray.get([trainer.logprobs.remote(*ids), old_policy.logprobs.remote(*ids)])
    before_old, after_new, after_old = [], [], []
    for i in spanning:
        engine_lp = np.asarray(out["response_logprobs"][i].as_py())
        switch = next(j for j, v in enumerate(versions[i]) if v >= 1)
        before_old.append(np.abs(engine_lp[:switch] - np.asarray(old[i][:switch])).max())
        after_new.append(np.abs(engine_lp[switch:] - np.asarray(new[i][switch:])))
        after_old.append(np.abs(engine_lp[switch:] - np.asarray(old[i][switch:])))
    assert max(before_old) < TOL  # tokens before the switch: exactly the old weights, in both modes
    if mode == "abort":
        assert max(d.max() for d in after_new) < TOL  # after it: exactly the new weights (prefix recomputed)
    else:  # new weights over the old weights' KV cache: nearer the new policy than the old, not equal to either
        assert np.mean(np.concatenate(after_new)) < np.mean(np.concatenate(after_old))
    ray.kill(engine)
