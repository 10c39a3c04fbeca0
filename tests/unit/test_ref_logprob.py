"""RefLogprob on the embedded tiny model: its logprobs are a plain HF forward's, micro-batching and padding
change nothing, and every response token gets one (masked tool tokens too)."""

import numpy as np
import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.tasks.embedded import build_embedded
from stages.ref_logprob import RefLogprob


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_embedded(tmp_path_factory.mktemp("ref"), num_prompts=8, seed=0).model_dir)


def direct(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """log p(response_t | prompt, response_<t) from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


def test_ref_logprobs_are_the_models_token_logprobs(model_dir):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 200, size=int(n)).tolist() for n in (3, 7, 5, 4, 6)]
    responses = [rng.integers(10, 200, size=int(n)).tolist() for n in (4, 1, 9, 6, 2)]
    masks = [[1] * len(r) for r in responses]
    masks[3][2:4] = [0, 0]  # a tool result in the middle of a response
    batch = pa.table({"prompt_ids": prompts, "response_ids": responses, "response_mask": masks})
    out = RefLogprob(model_dir, micro_batch_size=2)(batch)  # micro-batches of unequal lengths: padding matters
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    got = out["ref_logprobs"].to_pylist()
    for p, r, values in zip(prompts, responses, got, strict=True):
        assert len(values) == len(r)
        np.testing.assert_allclose(values, direct(model, p, r), atol=1e-5)
    assert all(v < 0 for v in got[3][2:4])  # masked tokens are scored too
    assert out.column_names[-1] == "ref_logprobs" and out["response_mask"].to_pylist() == masks


def test_the_reference_stays_frozen(model_dir):
    stage = RefLogprob(model_dir)
    assert not any(p.requires_grad for p in stage.model.parameters())
    assert all(p.dtype == torch.float32 for p in stage.model.parameters())
