"""Mixture of experts in the Megatron trainer: the model's MoE settings, and rollout routing replay.

The model (a Qwen3-MoE from config.json, stages/trainer/megatron_convert.py's ModelShape) is built from
megatron-core's local specs, with one expert module per expert (`moe_grouped_gemm=False`: the grouped GEMM needs
CUDA kernels), the `allgather` token dispatcher (`alltoall` makes a CUDA stream) and no load-balancing loss (the
objective is the PPO one alone). Qwen3's router maps onto megatron's top-k router: `norm_topk_prob` (top-k
probabilities renormalised) is softmax over the top-k logits, megatron's default; without it the softmax comes
first (`moe_router_pre_softmax`). Without TransformerEngine (on CPU, and on a GPU machine without it: seen on an
H100) one more shim: megatron-core's router GEMM calls TransformerEngine when imported, and without it raises
NameError, so `moe_utils.te_general_gemm` is set to None (its own fallback).

Replay uses megatron-core's RouterReplay (`moe_enable_routing_replay=True`): per forward pass, one LongTensor
(S * B, k) per MoE layer in REPLAY_FORWARD mode. megatron's hidden states are sequence-major, so token (b, s) is
row s * B + b. Its routing then gathers the probabilities from the current router logits at the replayed ids, so
the router still gets gradients. A forward pre-hook on each router computes the router's own top-k (no graph):
tokens without a replayed route (padding, each sequence's last token) take it, and it is what replayed routes
are compared with for actor/router_mismatch. RouterReplay keeps its state on the class, shared by every model of
the process: the instances are cleared before the model is built and the indices after each forward pass (no
activation recomputation here, so the backward never replays).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from stages.trainer.megatron_convert import ModelShape
from stages.trainer.route_tally import RouteTally
from stages.trainer.step import NO_ROUTE


def moe_config(shape: ModelShape, replay: bool) -> dict:
    """TransformerConfig keywords of the model's MoE layers (empty for a dense model)."""
    if not shape.is_moe:
        return {}
    return dict(
        qk_layernorm=shape.qk_layernorm,
        num_moe_experts=shape.num_experts,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size,
        moe_router_topk=shape.moe_topk,
        moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_layer_freq=[int(i in shape.moe_layers) for i in range(shape.num_layers)],
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False,
        moe_enable_routing_replay=replay,
    )


def layer_spec(config, shape: ModelShape):
    """The local spec: one layer spec for a dense model, the decoder block spec (dense and MoE layers as
    `moe_layer_freq` says) for a MoE one. Clears RouterReplay's class-level instances: the model built next owns
    them."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not shape.is_moe:
        return get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=shape.qk_layernorm)
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router_replay import RouterReplay

    if not hasattr(moe_utils, "te_general_gemm"):  # TransformerEngine absent (on CPU, or a GPU without it)
        moe_utils.te_general_gemm = None
    RouterReplay.clear_global_router_replay_instances()
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")


class MegatronRouteReplay:
    """Replays routes in a built GPTModel's MoE routers, through megatron-core's RouterReplay."""

    def __init__(self, model: torch.nn.Module, shape: ModelShape) -> None:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        if not self.routers:
            raise ValueError(
                "actor.router_replay.mode=R3 replays MoE routes, but the model has no MoE layers: set "
                "actor.router_replay.mode=disabled"
            )
        if [r.router_replay for r in self.routers] != RouterReplay.global_router_replay_instances:
            raise RuntimeError("RouterReplay's instances are not this model's routers: build one MoE model at a time")
        self.shape = shape
        self._tally: RouteTally | None = None  # the last `forcing` block's counts
        self._active = False
        for router in self.routers:
            router.register_forward_pre_hook(self._pre_hook)

    @contextmanager
    def forcing(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Within the block, forward passes replay `routes` (B, S, layers * k), batch-major as step.py pads them,
        and count into replayed/changed (reset here); None routes as the model does."""
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self._tally = None
        if routes is None:
            yield
            return
        layers, k = len(self.routers), self.shape.moe_topk
        if routes.shape[-1] != layers * k:
            raise ValueError(
                f"routed_experts rows hold {routes.shape[-1]} expert ids per token, but the model has {layers} MoE "
                f"layers x top-{k} = {layers * k}: the engine's routes are not this model's"
            )
        if routes.numel() and int(routes.max()) >= self.shape.num_experts:
            raise ValueError(f"routed_experts names expert {int(routes.max())}; the model has {self.shape.num_experts}")
        seq_major = routes.transpose(0, 1).reshape(-1, layers, k)  # (S * B, layers, k): row s * B + b
        self._tally = RouteTally(*routes.shape[:2], seq_major=True)
        device = self.routers[0].weight.device
        RouterReplay.set_replay_data([seq_major[:, i].to(device) for i in range(layers)])
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        self._active = True
        try:
            yield
        finally:
            self._active = False
            RouterReplay.clear_global_router_replay_action()
            RouterReplay.clear_global_indices()

    @torch.no_grad()
    def _pre_hook(self, router: torch.nn.Module, args: tuple) -> None:
        """Fill the rows without a replayed route with the router's own top-k, and count the replayed rows whose
        experts differ from it."""
        if not self._active:
            return
        logits = router.gating(args[0]).view(-1, router.config.num_moe_experts)  # (S * B, E)
        scores = torch.softmax(logits, -1, dtype=torch.float32) if router.config.moe_router_pre_softmax else logits
        own = torch.topk(scores, router.topk, dim=-1).indices  # (S * B, k)
        replay = router.router_replay
        forced = replay.target_topk_idx
        if forced.shape[0] != own.shape[0]:
            raise ValueError(f"routes cover {forced.shape[0]} tokens, the forward pass has {own.shape[0]}")
        given = forced[:, 0] != NO_ROUTE
        ids = torch.where(given[:, None], forced, own)
        replay.target_topk_idx = ids
        replay.replay_backward_list[-1] = ids  # what a recomputed forward would replay: the same routes
        self._tally.add(given, ids, own)

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
