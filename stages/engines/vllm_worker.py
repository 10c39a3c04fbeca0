"""vLLM worker extension: the engine side of the weight sync, and the MoE route capture.

vLLM mixes one class into every engine worker (`worker_extension_cls`): `EngineWorker`, made of `WeightReceiver` and
`RouteCapture`; the engine (stages/engines/vllm.py) reaches their methods through `collective_rpc`.

Weight sync: every worker of an engine (one per tensor-parallel rank) holds the receiver of the trainer's transport
(stages/transports: a gloo or NCCL broadcast, CUDA IPC, or pull mode's store), receives each tensor whole and loads
its own shard of it (vLLM's weight loaders cut it). A worker receives the tensors lazily inside the iterator it hands
to `reload_weights`, which brackets the copy with vLLM's layerwise reload (CPU linear layers repack their weights
after loading, so a plain `load_weights` after start-up would be wrong).

After every reload the CPU MoE experts are packed again (`repack_cpu_experts`): vLLM's reload leaves them in the
checkpoint layout, which its CPU kernel reads as garbage.

Route capture (stages/engines/vllm_routes.py is the engine's side): a capture function on every MoE router files the
experts it chose for each token of the batch under the token's request and position, while `execute_model` runs; the
engine fetches a finished request's rows with `fetch_routes`. Rows are filed by position, so a request recomputed
after a preemption overwrites its own rows. The engine must run without prefix caching: a cached prefix is not
recomputed, so it would have no rows.

`collective_rpc` arguments travel through msgspec, so names, shapes and dtypes are sent, never tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import numpy as np
import torch

from stages.transports import GroupAddress, WeightMeta, make_receiver
from stages.transports.store import StoreReceiver

# Requests whose routes were captured but never fetched (their caller failed) are dropped beyond this many, oldest
# first, so that the capture cannot grow without bound.
MAX_UNFETCHED_REQUESTS = 4096


class WeightReceiver:
    """Mixed into vLLM's worker class; `self.model_runner` and `self.rank` (its TP rank) are the worker's."""

    def init_weight_group(
        self, host: str, port: int, first_rank: int, world_size: int, backend: str, connect_timeout_s: float = 30.0
    ) -> None:
        """Join the trainer's group at `first_rank` (this engine's) plus this worker's rank in its engine, with the
        receiver of `backend` (stages/transports); a group joined before is left first."""
        old = getattr(self, "_weight_receiver", None)
        if old is not None:  # formed again after a replica restarted: the trainer has left the old one
            old.close()
        self._weight_receiver = make_receiver(backend)
        address = GroupAddress(host, port, backend, connect_timeout_s)
        self._weight_receiver.join(address, first_rank + self.rank, world_size)

    def receive_weights(self, names: list[str], shapes: list[list[int]], dtypes: list[str]) -> int:
        """Receive every named tensor from rank 0 and load it; returns the number of tensors loaded."""
        meta = WeightMeta(tuple(names), tuple(tuple(s) for s in shapes), tuple(dtypes))
        loaded = self._weight_receiver.receive(meta, self._reload)
        repack_cpu_experts(self.model_runner.get_model())
        return loaded

    def load_weights_file(self, url: str) -> int:
        """Pull mode: load a version the trainer published as one safetensors file; returns the tensor count."""
        loaded = StoreReceiver().receive(url, self._reload)
        repack_cpu_experts(self.model_runner.get_model())
        return loaded

    def _reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layerwise reload around the copy: CPU linear layers repack their weights after loading, so a plain
        `load_weights` after start-up would be wrong. It consumes `weights` lazily, as they arrive."""
        self.model_runner.reload_weights(weights_iterator=weights)

    def weight_checksum(self, name: str) -> float:
        """Sum of one parameter as this worker holds it: its TP rank's shard (tests use it to see a pushed change
        arrive at every rank). On CPU a linear layer's `weight` is empty once vLLM packed it: read an embedding or a
        norm."""
        params = dict(self.model_runner.get_model().named_parameters())
        return float(params[name].detach().float().sum())


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Pack the expert weights of every MoE layer served by vLLM's CPU kernel again, in place; returns how many.

    On the first load the CPU experts pack w13 and w2 into their grouped-gemm layout; a reload runs the layer's
    processing again but skips that step (it only builds the kernel on the first call), so the new weights stay in
    the checkpoint layout and the kernel computes garbage (measured: identical weights pushed again changed the
    greedy outputs). Layers of other kernels, and zentorch's, are left alone; a model without vLLM MoE kernels (a
    dense one) has nothing to repack, and vLLM's CPU modules are not imported for it."""
    kernels = [(m, getattr(getattr(m, "quant_method", None), "moe_kernel", None)) for m in model.modules()]
    kernels = [(m, k) for m, k in kernels if k is not None]
    if not kernels:
        return 0
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    packed = 0
    for module, kernel in kernels:
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        size = experts.moe_config.intermediate_size_per_partition
        if experts._padded_intermediate_size(experts.moe_config) != size:
            raise NotImplementedError(
                f"{type(module).__name__}: vLLM's CPU kernel pads experts of intermediate size {size}, and a reload "
                f"cannot repack padded experts; use a multiple of {experts._intermediate_alignment()}"
            )
        with torch.no_grad():
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(module, name)
                weight.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        packed += 1
    return packed


class RouteCapture:
    """Files the experts each MoE router chooses, per request and position; mixed into vLLM's worker."""

    def start_route_capture(self) -> dict[str, int]:
        """Register the capture function on every MoE router; returns the model's MoE `layers` and `topk`."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        runners = [m for m in self.model_runner.get_model().modules() if isinstance(m, MoERunner)]
        if not runners:
            raise ValueError("rollout.enable_rollout_routing_replay: the model has no MoE layer to capture routes of")
        experts = runners[0].router.global_num_experts
        if experts > 256:
            raise ValueError(f"routed_experts holds uint8 expert ids; this model has {experts} experts (at most 256)")
        self._route_slot = {lid: i for i, lid in enumerate(sorted(r.layer_id for r in runners))}
        self._route_topk = runners[0].router.top_k
        self._route_rows: dict[str, np.ndarray] = {}  # request -> (max_model_len, layers, topk) uint8
        self._route_filled: dict[str, int] = {}  # request -> rows filed (its highest position + 1)
        self._route_step: np.ndarray | None = None  # this forward's (tokens, layers, topk)
        for runner in runners:
            runner.router.set_capture_fn(partial(self._capture_route, runner.layer_id))
        return {"layers": len(runners), "topk": self._route_topk}

    def stop_route_capture(self) -> None:
        """Unregister the capture functions (bench/routes.py measures one engine with and without them)."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        for module in self.model_runner.get_model().modules():
            if isinstance(module, MoERunner):
                module.router.set_capture_fn(None)

    def _capture_route(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Called by a router inside the forward pass with its (tokens, topk) expert ids; layers come in order."""
        slot = self._route_slot[layer_id]
        if slot == 0:
            self._route_step = np.empty((topk_ids.shape[0], len(self._route_slot), self._route_topk), np.uint8)
        self._route_step[:, slot] = topk_ids.to(torch.uint8).cpu().numpy()
        if slot == len(self._route_slot) - 1:
            self._file_step()

    def _file_step(self) -> None:
        """Split the forward's rows by request: the batch is the scheduled requests' tokens back to back."""
        runner, step = self.model_runner, self._route_step
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.np[: num_reqs + 1]
        if num_reqs == 0 or starts[-1] > len(step):
            return  # not a scheduled batch (a dummy run)
        positions = runner.positions[: int(starts[-1])].cpu().numpy()
        for i, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            a, b = int(starts[i]), int(starts[i + 1])
            if a == b:
                continue
            rows = self._route_rows.get(req_id)
            if rows is None:
                rows = self._route_rows[req_id] = np.zeros((runner.max_model_len, *step.shape[1:]), np.uint8)
                self._forget_unfetched()
            p = int(positions[a])
            rows[p : p + b - a] = step[a:b]
            self._route_filled[req_id] = max(self._route_filled.get(req_id, 0), p + b - a)

    def _forget_unfetched(self) -> None:
        while len(self._route_rows) > MAX_UNFETCHED_REQUESTS:
            oldest = next(iter(self._route_rows))
            del self._route_rows[oldest], self._route_filled[oldest]

    def fetch_routes(self, request_ids: list[str]) -> list[bytes | None]:
        """The rows filed for each request (given by the id the stage submitted it under), positions 0.. as bytes of
        (rows, layers, topk) uint8, and forget them; None for a request with no rows."""
        out: list[bytes | None] = []
        for external in request_ids:
            # The engine runs a request under "<id>-<8 characters>" (vLLM's input processor).
            key = next((k for k in self._route_rows if k == external or k.rsplit("-", 1)[0] == external), None)
            if key is None:
                out.append(None)
                continue
            rows, filled = self._route_rows.pop(key), self._route_filled.pop(key)
            out.append(rows[:filled].tobytes())
        return out


class EngineWorker(WeightReceiver, RouteCapture):
    """What the Generate stage's engines mix into their worker (vLLM takes one `worker_extension_cls`)."""
