"""RouteTally: what one routing-replay forward did, per token: the MoE layers whose routes were replayed, and of
them those whose experts differ from the router's own top-k. Both replay hooks keep one (stages/trainer/
hf_router_replay.py, batch-major rows; stages/trainer/megatron_moe.py, sequence-major rows); the step compares its
per-token maps with the rows' versions (stages/trainer/step.py)."""

from __future__ import annotations

import torch


class RouteTally:
    def __init__(self, batch: int, seq: int, seq_major: bool) -> None:
        self.shape, self.seq_major = (batch, seq), seq_major
        self.counts = (torch.zeros(batch * seq), torch.zeros(batch * seq))  # replayed, changed layers per row

    def add(self, given: torch.Tensor, ids: torch.Tensor, own: torch.Tensor) -> None:
        """One layer's rows: `given` (N,) where a route was replayed, `ids` (N, k) the experts used, `own` (N, k)
        the router's own choice."""
        differs = (ids.sort(-1).values != own.sort(-1).values).any(-1) & given
        self.counts[0].add_(given.float().cpu())
        self.counts[1].add_(differs.float().cpu())

    @property
    def replayed(self) -> float:
        return float(self.counts[0].sum())

    @property
    def changed(self) -> float:
        return float(self.counts[1].sum())

    def maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S) MoE layers replayed and changed per token."""
        b, s = self.shape
        if self.seq_major:
            return self.counts[0].view(s, b).T, self.counts[1].view(s, b).T
        return self.counts[0].view(b, s), self.counts[1].view(b, s)
