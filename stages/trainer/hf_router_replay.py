"""Routing replay in a transformers MoE model (TorchTrainer): every router forced to given experts.

transformers has no forced routing, so each MoE layer's router gets its own `forward` (an instance attribute, the
class is left alone) that computes the logits and the softmax as the model's router does, takes the replayed expert
ids where a token has them and the router's own top-k where it has none (padding, each sequence's last token), and
gathers the softmax at those ids, renormalised when the model's router renormalises (`norm_topk_prob`). So the
experts are forced while the router weights still get gradients through the gathered probabilities. With no
routes set (`forcing(None)`, or any call outside `forcing`) the router is exactly the model's own.

transformers flattens (B, S) tokens batch-major before its routers: token (b, s) is row b * S + s.

Supported: the routers whose own forward is softmax -> top-k -> optional renormalisation (Qwen3-MoE, Qwen2-MoE;
Mixtral always renormalises); another MoE model is one clear error rather than silently different routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from stages.trainer.route_tally import RouteTally
from stages.trainer.step import NO_ROUTE

ROUTERS = {"Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter", "MixtralTopKRouter"}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order; one clear error for a router this replay does not know."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    unknown = sorted({type(m).__name__ for m in routers} - ROUTERS)
    if unknown:
        raise ValueError(
            f"actor.router_replay knows the routers {sorted(ROUTERS)}, not {unknown}: set actor.router_replay.mode="
            "disabled for this model"
        )
    return routers


class HFRouterReplay:
    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        if not self.routers:
            kind = getattr(model.config, "model_type", type(model).__name__)
            raise ValueError(
                f"actor.router_replay.mode=R3 replays MoE routes, but the model ({kind}) has no MoE layers: set "
                "actor.router_replay.mode=disabled"
            )
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].num_experts
        self._routes: torch.Tensor | None = None  # (B * S, layers, k), NO_ROUTE where the router picks
        self._tally: RouteTally | None = None  # the last `forcing` block's counts
        for layer, router in enumerate(self.routers):
            router.forward = self._forward_of(router, layer)

    @contextmanager
    def forcing(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Within the block, forward passes replay `routes` (B, S, layers * k) and count into replayed/changed and
        `maps()` (reset here); None leaves the routers alone."""
        self._tally = None
        if routes is None:
            yield
            return
        layers, k = len(self.routers), self.top_k
        if routes.shape[-1] != layers * k:
            raise ValueError(
                f"routed_experts rows hold {routes.shape[-1]} expert ids per token, but the model has {layers} MoE "
                f"layers x top-{k} = {layers * k}: the engine's routes are not this model's"
            )
        if routes.numel() and int(routes.max()) >= self.num_experts:
            raise ValueError(f"routed_experts names expert {int(routes.max())}; the model has {self.num_experts}")
        self._routes = routes.reshape(-1, layers, k)
        self._tally = RouteTally(*routes.shape[:2], seq_major=False)
        try:
            yield
        finally:
            self._routes = None

    def _forward_of(self, router: torch.nn.Module, layer: int):
        normalise = getattr(router, "norm_topk_prob", True)  # Mixtral's router has no switch: it always does

        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            hidden = hidden_states.reshape(-1, router.hidden_dim)  # (N, H), N = B * S batch-major
            logits = F.linear(hidden, router.weight)  # (N, E)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            ids = torch.topk(probs, router.top_k, dim=-1).indices  # (N, k): the router's own choice
            if self._routes is not None:
                ids = self._replay(layer, ids)
            top = probs.gather(-1, ids)  # (N, k)
            if normalise:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), ids

        return forward

    def _replay(self, layer: int, own: torch.Tensor) -> torch.Tensor:
        """This layer's replayed ids (N, k) where given, `own` elsewhere; counts the replayed and changed rows."""
        forced = self._routes[:, layer].to(own.device)  # (N, k)
        if forced.shape[0] != own.shape[0]:
            raise ValueError(f"routes cover {forced.shape[0]} tokens, the forward pass has {own.shape[0]}")
        given = forced[:, 0] != NO_ROUTE
        ids = torch.where(given[:, None], forced, own)
        self._tally.add(given, ids, own)
        return ids

    @property
    def replayed(self) -> float:
        """(token, MoE layer) pairs replayed in the last `forcing` block."""
        return 0.0 if self._tally is None else self._tally.replayed

    @property
    def changed(self) -> float:
        """Of them, those whose experts differ from the router's own top-k."""
        return 0.0 if self._tally is None else self._tally.changed

    def maps(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(B, S) MoE layers replayed and changed per token in the last `forcing` block (None without routes)."""
        return None if self._tally is None else self._tally.maps()
