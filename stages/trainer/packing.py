"""Padding-free packing (verl's `model.use_remove_padding`): a micro-batch's sequences, prompt + response each,
concatenated into one row of N tokens, positions restarting at 0 for each, attention confined to each.

Right-padded, a micro-batch of long-tailed lengths computes B x (longest) tokens, most of them padding; packed it
computes the N real ones. Three parts:
- `pack`: the (1, N) token ids and positions, the sequences' boundaries (`cu_seqlens`, as flash attention's varlen
  interface takes them) and where each response token's logit is;
- the attention: transformers' models call an attention function by name; `use_packed_attention` registers this
  module's and switches a model to it. Given `cu_seq_lens_q` it attends within each sequence: torch's varlen flash
  attention on a GPU in bf16/fp16 (`torch.nn.attention.varlen`, no flash_attn package needed), else SDPA causal on
  each sequence's slice (CPU, fp32), so the work is sum L^2, not N^2. transformers' own packed path (SDPA with the
  block-diagonal N x N mask it builds from restarting positions) gives the same values, but computes all N^2 scores:
  measured no faster than padding on the embedded model (bench/trainer_efficiency.py's notes). Without
  `cu_seq_lens_q` the function is SDPA with transformers' own mask, so the padded path keeps working on the model;
- the logits: only at the positions that predict a response token (`logits_to_keep`), (R, V) for R response
  tokens, spread back to (B, T) rows.

MoE routing replay packs its (B, S, ...) routes the same way (`pack_context`) and unpacks the per-token maps
(`unpack_context`). A sliding-window layer (a Qwen2/Mistral config's `sliding_window`) attends within its window
in each sequence, on both paths.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import numpy as np
import torch

from stages.trainer.loss import TokenForward, entropy_from_logits

ATTENTION = "asyncrl_packed"


@dataclass
class Packed:
    """One micro-batch packed into a single row."""

    ids: torch.Tensor  # (1, N) the sequences' tokens back to back
    positions: torch.Tensor  # (1, N) each token's position within its own sequence
    cu_seqlens: torch.Tensor  # (B + 1,) int32: sequence b is tokens cu_seqlens[b]:cu_seqlens[b + 1]
    lengths: list[int]  # the B sequences' lengths (prompt + response)
    keep: torch.Tensor  # (R,) packed positions whose logits predict a response token, row by row
    targets: torch.Tensor  # (R,) the response token each predicts
    rows: torch.Tensor  # (R,) its response's row in the micro-batch
    cols: torch.Tensor  # (R,) its index within the response
    width: int  # the longest response: the (B, T) tensors' T

    def model_inputs(self) -> dict:
        """The keywords of a transformers causal LM's forward over this row."""
        longest = max(self.lengths, default=0)
        return {
            "input_ids": self.ids,
            "position_ids": self.positions,
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": longest,
            "max_length_k": longest,
            "use_cache": False,
            "logits_to_keep": self.keep,
        }

    def spread(self, values: torch.Tensor) -> torch.Tensor:
        """(R,) per-response-token values into (B, T) rows, zero after each response's end (differentiable)."""
        out = values.new_zeros(len(self.lengths), self.width)
        return out.index_put((self.rows, self.cols), values)

    def mask(self) -> torch.Tensor:
        """(B, T) 1 on the real response tokens."""
        return self.spread(torch.ones(len(self.keep), device=self.ids.device))

    def pack_context(self, t: torch.Tensor) -> torch.Tensor:
        return pack_rows(t, self.lengths)

    def unpack_context(self, t: torch.Tensor) -> torch.Tensor:
        return unpack_rows(t, self.lengths)


def pack_rows(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(B, S, ...) per-context-token values, right-padded, as one packed row (1, N, ...) of these lengths."""
    return torch.cat([t[b, :n] for b, n in enumerate(lengths)])[None]


def unpack_rows(t: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(1, N, ...) per-token values of a packed row as (B, S, ...), S the longest sequence, zero-padded."""
    out = t.new_zeros(len(lengths), max(lengths, default=0), *t.shape[2:])
    start = 0
    for b, n in enumerate(lengths):
        out[b, :n] = t[0, start : start + n]
        start += n
    return out


def pack(prompts: list, responses: list, device: torch.device | str = "cpu") -> Packed:
    """Pack the (prompt, response) pairs, in order, into one row on `device`."""
    seqs = [
        np.concatenate([np.asarray(p, np.int64), np.asarray(r, np.int64)])
        for p, r in zip(prompts, responses, strict=True)
    ]
    lengths = [len(s) for s in seqs]
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    keep, rows, cols = [], [], []
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        first = starts[b] + len(p) - 1  # the logits at position t predict token t + 1
        keep.append(np.arange(first, first + len(r)))
        rows.append(np.full(len(r), b))
        cols.append(np.arange(len(r)))
    ids = np.concatenate(seqs) if seqs else np.zeros(0, np.int64)
    keep_at = np.concatenate(keep).astype(np.int64) if keep else np.zeros(0, np.int64)

    def tensor(a: np.ndarray, dtype=torch.long) -> torch.Tensor:
        return torch.as_tensor(a, dtype=dtype).to(device)

    return Packed(
        ids=tensor(ids)[None],
        positions=tensor(np.concatenate([np.arange(n) for n in lengths]) if lengths else ids)[None],
        cu_seqlens=tensor(starts, torch.int32),
        lengths=lengths,
        keep=tensor(keep_at),
        targets=tensor(ids[keep_at + 1] if len(keep_at) else keep_at),
        rows=tensor(np.concatenate(rows) if rows else keep_at),
        cols=tensor(np.concatenate(cols) if cols else keep_at),
        width=max((len(r) for r in responses), default=0),
    )


def use_packed_attention(model: torch.nn.Module) -> None:
    """Register this module's attention with transformers and switch `model` to it (padded calls still get SDPA
    with their mask; packed calls, which pass cu_seq_lens_q, attend within each sequence)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _mask_unless_packed(sdpa_mask))
    model.set_attn_implementation(ATTENTION)


def _mask_unless_packed(sdpa_mask):
    """SDPA's mask for a padded batch; none for a call without a padding mask: a packed row (its restarting positions
    would otherwise make transformers build the block-diagonal N x N mask) or one unpadded causal batch."""

    def mask(*args, attention_mask=None, **kwargs):
        if attention_mask is None:
            return None
        return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    return mask


def packed_attention(module, query, key, value, attention_mask, cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention-function contract: query (1, H, N, D), key and value (1, H_kv, N, D); returns
    ((1, N, H, D), None). With `cu_seq_lens_q`, causal attention within each packed sequence."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    window = kwargs.pop("sliding_window", None)
    half = _half_dtype(query)
    if half is not None and _varlen() is not None:
        q, k, v = (t.to(half) for t in (query, key, value))
        return _varlen_attention(q, k, v, cu_seq_lens_q, int(max_length_q), window, kwargs), None
    kwargs.pop("is_causal", None)
    # One split per tensor, not a slice per sequence: a slice's backward writes its gradient into a zeroed tensor
    # of the whole row, one such row per sequence; a split's backward is a single concatenation.
    lengths = torch.diff(cu_seq_lens_q).tolist()
    pieces = []
    for q, k, v in zip(*(t.split(lengths, dim=2) for t in (query, key, value)), strict=True):
        n = q.shape[2]
        mask = None if window is None or n <= window else _window_mask(n, window, query.device)
        pieces.append(sdpa_attention_forward(module, q, k, v, mask, is_causal=mask is None, **kwargs)[0])
    return torch.cat(pieces, dim=1), None


def _window_mask(n: int, window: int, device) -> torch.Tensor:
    """(1, 1, n, n) True where query i may attend key j: causal and within the window, 0 <= i - j < window, as
    transformers' sliding-window mask has it."""
    i = torch.arange(n, device=device)
    gap = i[:, None] - i[None, :]
    return ((gap >= 0) & (gap < window))[None, None]


def _half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype the flash kernel runs in here: the query's, or autocast's (under autocast the rotary
    embedding leaves the query and key in fp32); None on CPU or in fp32."""
    if not query.is_cuda:
        return None
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else None


def _varlen():
    """torch's varlen flash attention, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_attention(query, key, value, cu_seqlens, longest: int, window: int | None, kwargs: dict) -> torch.Tensor:
    """(1, N, H, D) causal attention within each sequence (within `window` tokens back when given) by torch's varlen
    flash kernel, in its (N, H, D) layout."""
    varlen_attn = _varlen()
    params = inspect.signature(varlen_attn).parameters
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, H, D)
    groups = q.shape[1] // k.shape[1]
    extra = {"scale": kwargs.get("scaling")}
    if groups > 1:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "window_size" in params:
        extra["window_size"] = (-1 if window is None else window - 1, 0)  # causal: (left, right) of each query
    elif window is not None:
        raise ValueError(
            "model.use_remove_padding on a GPU with sliding-window attention layers needs a torch whose varlen "
            "attention takes window_size: a newer torch, or model.use_remove_padding=false"
        )
    else:
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, longest, longest, **extra)
    return out[None]  # (1, N, H, D)


def packed_forward(
    model: torch.nn.Module,
    prompts: list,
    responses: list,
    device: torch.device | str = "cpu",
    entropy: bool = False,
    entropy_grad: bool = True,
    replay=None,
    routes: torch.Tensor | None = None,
    precision: contextlib.AbstractContextManager | None = None,
    sum_pi2: bool = False,
) -> TokenForward:
    """A transformers causal LM's response-token logprobs (B, T), and their entropy when asked, from one packed
    forward on `device`; `replay` (stages/trainer/hf_router_replay.py) forces `routes` (B, S, layers * k) when
    given. `precision`: the context the model's forward runs in (stages/trainer/precision.py's autocast); the
    logprobs and entropy are computed from float32 logits after it. `sum_pi2`: also each token's sum of squared
    probabilities (the optimal token baseline's, stages/advantage/otb.py)."""
    packed = pack(prompts, responses, device)
    packed_routes = None if routes is None else packed.pack_context(routes.to(device))
    forcing = replay.forcing(packed_routes) if replay is not None else contextlib.nullcontext()
    with forcing, precision or contextlib.nullcontext():
        logits = model(**packed.model_inputs()).logits[0]
    logits = logits.float()  # (R, V)
    logp = torch.log_softmax(logits, -1).gather(-1, packed.targets[:, None]).squeeze(-1)
    ent = packed.spread(entropy_from_logits(logits, grad=entropy_grad)) if entropy else None
    out = TokenForward(packed.spread(logp), packed.mask(), ent)
    if sum_pi2:
        out.sum_pi2 = packed.spread(torch.softmax(logits, -1).pow(2).sum(-1))
    if replay is not None and routes is not None:
        maps = replay.maps()
        out.routes_replayed, out.routes_changed = replay.replayed, replay.changed
        out.route_maps = (packed.unpack_context(maps[0]), packed.unpack_context(maps[1]))
    return out
