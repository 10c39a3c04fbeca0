"""trainer.backend=megatron end to end: converted weights reach the vLLM engine, and the embedded job learns.

The first test starts the engine from one random model and a TP=2 MegatronTrainer from another of the same shape
(so the push visibly changes what the engine generates; one update of the trainer's own start weights at a
learning rate large enough to change greedy tokens collapses this random model onto one token, which would make
the comparison vacuous). After one small update the trainer pushes over the gloo weight-sync group, and the
engine's greedy tokens are compared with an HF Qwen2 holding the same weights (the trainer's pull-mode
safetensors file): they must be identical. The second runs the embedded job with conf/megatron.yaml and asserts
that the reward rises and the staleness audit passes.
"""

import json
import time

import numpy as np
import pyarrow as pa
import pytest
import torch

from pipeline import sync
from pipeline.clock import VersionClock
from pipeline.config import CONF_DIR
from pipeline.tasks.embedded import build_embedded, build_model
from stages.generate import VLLMGenerate
from stages.staleness import StalenessBudget
from stages.trainer.megatron_backend import MegatronTrainer
from stages.trainer.settings import PolicySettings
from tests.pipeline.engine_checks import prompts

MAX_TOKENS = 12
SHORT_RUN = [
    "actor.megatron.tensor_model_parallel_size=1",
    "rollout.total_rollout_steps=200",
    "actor.lr=1e-3",
    "data.max_response_length=32",  # derailed answers stop sooner; the longest right answer is 21 tokens
    "model.warm_start_steps=400",
    "trainer.monitor=jsonl",
]
TEXTS = ["reverse: a b c =", "reverse: d e =", "reverse: f g h i =", "reverse: k l m n o p ="]


def _hf_greedy(weights_file, model_dir, batch: pa.Table) -> list[list[int]]:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(load_file(weights_file))
    out = []
    for ids in batch["prompt_ids"].to_pylist():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=0, pad_token_id=1
        )
        out.append(seq[0, len(ids) :].tolist())
    return out


@pytest.mark.slow
def test_megatron_weights_in_the_engine_give_hf_greedy_tokens(ray_session, tmp_path):
    ray = ray_session
    from transformers import AutoTokenizer

    task = build_embedded(tmp_path, 20, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    other = tmp_path / "other"
    build_model(other, len(tokenizer), seed=7)  # same shape and vocabulary, other weights
    clock = (
        ray.remote(VersionClock)
        .options(name="clock-mg", namespace="mg", num_cpus=0, max_concurrency=100)
        .remote(StalenessBudget(0.0, 1, 1, 2), 1)
    )
    trainer = (
        ray.remote(MegatronTrainer)
        .options(num_cpus=1)
        .remote(str(other), PolicySettings(lr=1e-5), tensor_model_parallel_size=2)
    )
    engine = (
        ray.remote(VLLMGenerate)
        .options(num_cpus=1)
        .remote(str(task.model_dir), "clock-mg", "mg", n=1, max_tokens=MAX_TOKENS, temperature=0.0)
    )
    batch = prompts(tokenizer, TEXTS)
    before = ray.get(engine.__call__.remote(batch))

    rng = np.random.default_rng(0)
    mb = {**before.to_pydict(), "advantage": rng.choice([-1.0, 1.0], before.num_rows).tolist()}
    ray.get(trainer.train_step.remote([mb]))
    pusher = sync.Push(trainer, clock, 1, tmp_path)
    pusher.connect()
    stats = pusher.sync(1)
    assert stats["sync/bytes"] > 0
    weights = tmp_path / "pushed.safetensors"
    ray.get(trainer.publish_weights.remote(str(weights)))

    after = ray.get(engine.__call__.remote(batch))
    assert {v for vs in after["token_param_version"].to_pylist() for v in vs} == {1}
    engine_tokens = after["response_ids"].to_pylist()
    hf_tokens = _hf_greedy(weights, other, batch)
    print("greedy engine", engine_tokens, "hf", hf_tokens, "before", before["response_ids"].to_pylist())
    assert engine_tokens == hf_tokens
    assert engine_tokens != before["response_ids"].to_pylist()  # the push changed what the engine generates
    assert len({t for row in engine_tokens for t in row}) > 4  # varied tokens: a comparison that can fail
    ray.kill(engine)
    ray.kill(trainer)


@pytest.mark.slow
def test_embedded_job_learns_with_megatron(run_job):
    start = time.monotonic()
    # TP=1 here (TP=2 is checked above and in tests/distributed): two ranks beside the engine on 2 cores double
    # the wall time of the same steps.
    summary, run_dir = run_job(*SHORT_RUN, config=str(CONF_DIR / "megatron.yaml"), name="megatron")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [round(r["reward/mean"], 2) for r in rows]
    print(f"megatron run: {summary['steps']} steps in {time.monotonic() - start:.0f} s, reward curve {curve}")
    assert summary["audit_ok"]
    # The first and last quarter of the steps (6 each): the summary's tenths are 2 steps of 8 prompts here, and one
    # lucky early step (0.24 in 0.14-0.18) once left them 0.09 apart on a curve that rose from 0.16 to 0.32 by
    # quarters. Measured by quarters: +0.16; a flat or falling reward fails.
    quarter = max(1, len(rows) // 4)
    rewards = [r["reward/mean"] for r in rows]
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last - first >= 0.1, curve
