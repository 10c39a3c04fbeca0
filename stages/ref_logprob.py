"""RefLogprob: each response token's logprob under the frozen initial policy (the reference of the KL loss and of
the KL in the reward).

Input columns:  prompt_ids, response_ids
Output columns: input columns + ref_logprobs (list<float32>, one per response token)

The model is the HF directory the run starts from, loaded once per actor and never updated: on the GPU the actor is
given (ray.gpus_per_reference) in bf16, as verl's forward-only reference, else on the CPU in float32; the logprobs are
computed from float32 logits either way.
Every response token gets a value, masked (tool-result) ones too, so the column keeps the response's length; the
consumers mask. The logits are not divided by a temperature, as the trainer computes its own logprobs, so a KL
between the two compares like with like. Sequences go through the model `micro_batch_size` at a time, or by a token
budget (verl's `ref.log_prob_use_dynamic_bsz`, stages/trainer/micro_batches.py), right-padded with an attention
mask or packed into one row (`use_remove_padding`, stages/trainer/packing.py); with `param_offload` the weights
wait in CPU memory between calls (stages/trainer/offload.py; nothing moves on a CPU device).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from schemas import SAMPLE_SCHEMA, require_columns
from stages.trainer.balance import row_tokens
from stages.trainer.micro_batches import MicroBatching
from stages.trainer.offload import Offload
from stages.trainer.packing import packed_forward, use_packed_attention
from stages.trainer.precision import compute_dtype, pick_device


class RefLogprob:
    def __init__(
        self,
        model_dir: str,
        micro_batch_size: int = 8,
        num_threads: int = 1,
        use_remove_padding: bool = False,
        use_dynamic_bsz: bool = False,
        max_token_len: int = 16384,
        param_offload: bool = False,
        dtype: str | None = None,
        device: str | None = None,
    ) -> None:
        """`dtype` ('bf16', 'fp32'): the model's; None: bf16 on a GPU, fp32 on CPU. `device`: None is the GPU this
        process sees, else the CPU."""
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(num_threads)  # a stage actor shares a few cores with the engines and the trainer
        self.device = pick_device(device)
        weights = compute_dtype(dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=weights).to(self.device)
        self.model.eval().requires_grad_(False)
        self.batching = MicroBatching(
            micro_batch_size, use_dynamic_bsz, max_token_len, "ref.log_prob_max_token_len_per_gpu"
        )
        self.packed = use_remove_padding
        if use_remove_padding:
            use_packed_attention(self.model)
        self.offload = Offload(self.model, None, self.device, params=param_offload)
        self.pad = self.model.config.pad_token_id or 0  # any id: the attention mask hides the padding

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, ["prompt_ids", "response_ids"], "RefLogprob")
        prompts = batch.column("prompt_ids").to_pylist()
        responses = batch.column("response_ids").to_pylist()
        out: list = [None] * len(responses)
        with self.offload.active():
            for index in self.batching.cut(row_tokens({"prompt_ids": prompts, "response_ids": responses})):
                values = self.logprobs([prompts[i] for i in index], [responses[i] for i in index])
                for i, row in zip(index, values, strict=True):
                    out[i] = row
        field = SAMPLE_SCHEMA.field("ref_logprobs")
        return batch.append_column(field, pa.array(out, field.type))

    @torch.no_grad()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
        """The response tokens' logprobs of one micro-batch, one float32 array per response."""
        if self.packed:
            logp = packed_forward(self.model, prompts, responses, self.device).logp.cpu()
            return [logp[i, : len(r)].numpy() for i, r in enumerate(responses)]
        seqs = [list(p) + list(r) for p, r in zip(prompts, responses, strict=True)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            attn[i, : len(s)] = 1
        logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits
        out = []
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            start = len(p) - 1  # the logits at position t predict token t + 1
            logp = torch.log_softmax(logits[i, start : start + len(r)].float(), dim=-1)  # the response rows only
            target = torch.tensor(r, dtype=torch.long, device=self.device)[:, None]
            out.append(logp.gather(-1, target).squeeze(-1).cpu().numpy())
        return out
