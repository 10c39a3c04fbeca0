"""Where a multi-rank trainer's peers run and where its ranks meet: one node, or one placement bundle per node.

One node (`trainer.nnodes=1`, the default): every peer goes on rank 0's node (a hard node affinity) and the ranks
meet on 127.0.0.1, which nothing outside the machine can reach.

Several nodes: the driver reserves one placement-group bundle per trainer node (pipeline/prepare.py, STRICT_SPREAD:
no two bundles on one node) and starts rank 0 in the first. Rank r goes in bundle r // ranks_per_node, so
consecutive ranks share a node: megatron orders its ranks TP first, and a tensor-parallel group, whose collectives
run in every layer, stays on one node's links (the config requires n_gpus_per_node to be a multiple of TP). The ranks
meet on rank 0's node address as Ray knows it (`--node-ip-address`: 127.0.0.1 on a one-machine cluster), the same
address Ray's own services on that node listen on.
"""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class RankPlacement:
    """How a trainer places its peer ranks. `group`: a Ray PlacementGroup of one bundle per trainer node (None: one
    node, rank 0's)."""

    group: object = None
    ranks_per_node: int = 0

    @property
    def multi_node(self) -> bool:
        return self.group is not None

    def host(self) -> str:
        """The address the ranks meet on: loopback on one node, else this (rank 0's) node's address."""
        return node_address() if self.multi_node else LOOPBACK

    def strategy(self, rank: int):
        """The scheduling strategy of peer `rank`."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

        if not self.multi_node:
            return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank // self.ranks_per_node)


def node_address() -> str:
    """This process's node address as Ray knows it; loopback outside Ray (a trainer built in-process by a test, or
    on a machine without Ray: bench/gpu_check)."""
    if "ray" not in sys.modules:  # never imported here: no Ray session in this process
        return LOOPBACK
    import ray

    if not ray.is_initialized():
        return LOOPBACK
    return ray.util.get_node_ip_address()


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now, for a rendezvous that binds it next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_world(backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = 600) -> None:
    """Join torch.distributed's global group at host:port. Rank 0 serves the rendezvous store on a socket bound to
    `host` alone: `init_process_group(init_method="tcp://...")` would have its store listen on every interface."""
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        listener = socket.create_server((host, port))
        fd = listener.detach()
        try:
            store = dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)
        except Exception:
            socket.close(fd)
            raise
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
