"""A Megatron micro-batch's model inputs: B right-padded rows with a causal mask, or
(`actor.megatron.use_remove_padding`) the B sequences packed into one row with a block-diagonal causal mask.

megatron-core's own packed format (`PackedSeqParams`, 'thd' layout, cu_seqlens) needs TransformerEngine's attention:
the local layer spec this backend builds on (TransformerEngine does not install on CPU) refuses it, its
DotProductAttention asserting `packed_seq_params is None`. So a packed row here is a (1, N) batch whose mask keeps
each token to its own sequence. Positions run on across the row (megatron's RoPE numbers positions 0..N-1): exact all
the same, since a rotary attention score depends only on the distance between query and key, which is the same within
a sequence wherever it starts (tests/distributed/test_megatron_packing.py compares with the padded logprobs). The local
attention still computes all N x N scores, so here packing saves the padding's linear layers and MLPs (most of a
long-tailed micro-batch) but not the attention's work, whose scores grow with the square of the packed length: bound
it with a token budget (actor.use_dynamic_bsz).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Inputs:
    """One micro-batch's model inputs and where each sequence sits in them."""

    prompts: list
    responses: list
    ids: torch.Tensor  # (B, S) right-padded, or (1, N) packed
    positions: torch.Tensor  # same shape: 0.. per row
    causal: torch.Tensor  # (1, 1, S, S) bool, True = masked out
    rows: list[int]  # the batch row of each sequence (all 0 when packed)
    starts: list[int]  # the offset of each sequence in its row
    packed: bool = False

    @property
    def lengths(self) -> list[int]:
        return [len(p) + len(r) for p, r in zip(self.prompts, self.responses, strict=True)]

    def response_values(self, per_token: torch.Tensor, width: int) -> torch.Tensor:
        """(B, T) each response token's value from per-context-token values (rows, S) at the logits that predict
        it (position t predicts token t + 1), zero after each response's end."""
        out = per_token.new_zeros(len(self.responses), width)
        for i, (p, r, row, start) in enumerate(zip(self.prompts, self.responses, self.rows, self.starts, strict=True)):
            first = start + len(p) - 1
            out[i, : len(r)] = per_token[row, first : first + len(r)]
        return out


def model_inputs(prompts: list, responses: list, pad: int, device: torch.device, packed: bool) -> Inputs:
    """Padded or packed inputs of these (prompt, response) pairs on `device`."""
    seqs = [np.concatenate([p, r]).astype(np.int64) for p, r in zip(prompts, responses, strict=True)]
    if packed:
        ids = torch.as_tensor(np.concatenate(seqs))[None].to(device)  # (1, N)
        lengths = [len(s) for s in seqs]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        return Inputs(
            prompts, responses, ids, _positions(ids), block_causal(lengths, device), [0] * len(seqs), starts, True
        )
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)  # (B, S), right-padded
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
    ids = ids.to(device)
    # True = masked out; right padding needs no more than causality for the positions we read.
    causal = torch.triu(torch.ones(width, width, dtype=torch.bool, device=device), 1)[None, None]
    return Inputs(prompts, responses, ids, _positions(ids), causal, list(range(len(seqs))), [0] * len(seqs))


def _positions(ids: torch.Tensor) -> torch.Tensor:
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids)


def block_causal(lengths: list[int], device: torch.device) -> torch.Tensor:
    """(1, 1, N, N) bool mask, True where a token may not attend: a later token, or one of another sequence."""
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.as_tensor(lengths, device=device))
    n = seq.shape[0]
    later = torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), 1)
    return (later | (seq[:, None] != seq[None, :]))[None, None]
