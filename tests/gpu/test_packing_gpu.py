"""GPU checks of padding-free packing and offload (skip themselves without CUDA); they import neither Ray nor vLLM.

- bf16 under autocast, packed goes through torch's varlen flash attention (stages/trainer/packing.py): its response
  logprobs against the padded path's (SDPA) within bf16's rounding, 0.05, and its backward runs;
- fp32, packed goes through SDPA on each sequence: within 2e-5 of padded, as on CPU;
- offload (stages/trainer/offload.py): between steps the parameters and AdamW's state are in CPU memory, the GPU
  holds none of them, and the update equals the update without offload.
"""

import numpy as np
import pytest
import torch

from stages.trainer.offload import Offload
from stages.trainer.packing import packed_forward, use_packed_attention

pytestmark = pytest.mark.gpu
VOCAB = 300


def _model(seed: int = 0) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, **shape)).cuda()


def _batch() -> tuple[list, list]:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (3, 9, 2, 6)]
    responses = [rng.integers(2, VOCAB, n).tolist() for n in (1, 200, 5, 60)]
    return prompts, responses


def _padded_logprobs(model, prompts: list, responses: list) -> torch.Tensor:
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
    logits = model(input_ids=ids.cuda(), attention_mask=attn.cuda()).logits.float()
    out = torch.zeros(len(seqs), max(map(len, responses)), device="cuda")
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        logp = torch.log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(r)], -1)
        out[i, : len(r)] = logp.gather(-1, torch.tensor(r, device="cuda")[:, None]).squeeze(-1)
    return out


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 0.05), (torch.float32, 2e-5)])
def test_packed_equals_padded_on_the_gpu(dtype, tol, monkeypatch):
    from stages.trainer import packing

    calls, varlen = [], packing._varlen_attention
    monkeypatch.setattr(packing, "_varlen_attention", lambda *a, **k: calls.append(1) or varlen(*a, **k))
    model, (prompts, responses) = _model(), _batch()
    with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
        padded = _padded_logprobs(model, prompts, responses)
        use_packed_attention(model)
        packed = packed_forward(model, prompts, responses, "cuda", entropy=True)
    assert len(calls) == (2 if dtype == torch.bfloat16 else 0)  # the flash kernel in each of the 2 layers, in bf16
    on = packed.mask > 0
    assert float((packed.logp - padded)[on].abs().max()) < tol
    (packed.logp * packed.mask).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_offload_parks_the_weights_and_the_optimizer_state_and_changes_no_update():
    prompts, responses = _batch()
    results = []
    for offload in (False, True):
        before = torch.cuda.memory_allocated()
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        parked = Offload(model, optimizer, torch.device("cuda"), params=offload, optimizer_state=offload)
        for _ in range(2):
            with parked.active():
                assert next(model.parameters()).is_cuda
                optimizer.zero_grad(set_to_none=True)
                _padded_logprobs(model, prompts, responses).sum().backward()
                optimizer.step()
            if offload:
                assert all(not p.is_cuda for p in model.parameters())
                state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
                assert state and all(not v.is_cuda for v in state)
                assert torch.cuda.memory_allocated() - before < 1 << 20  # nothing of the model's left on the GPU
        results.append({n: p.detach().cpu() for n, p in model.named_parameters()})
        del model, optimizer, parked
    for name, value in results[0].items():
        assert torch.equal(value, results[1][name]), name
