"""A transport's private process group: its own TCP rendezvous and store, outside torch.distributed's global state.

A Megatron trainer owns the global group, and an engine's workers own vLLM's; the weight-sync group is a third
one that touches neither (torch.distributed's `init_process_group` would replace the global one). It is built from
torch's own classes, so a transport runs where vLLM is not installed (the trainer side, a GPU check of one pair).
Rank 0 serves the rendezvous store on a socket it bound itself (`listen`), so it listens on the one interface it
chose; the others connect to it. A member that never arrives makes everyone's `open_group` fail after `timeout`.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, ProcessGroup, TCPStore


def listen(host: str) -> socket.socket:
    """A socket bound to `host` on a free port, for rank 0's rendezvous store."""
    return socket.create_server((host, 0))


def open_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    listener: socket.socket | None = None,
) -> ProcessGroup:
    """Join (rank 0: serve on `listener`) the rendezvous at host:port and form a `backend` group ('gloo' or
    'nccl') of `world_size` ranks; collectives in it take `group_src`/`group_dst` ranks of this group."""
    if rank == 0:
        if listener is None:
            raise ValueError("rank 0 serves the rendezvous: pass the socket from listen()")
        fd = listener.detach()
        try:
            store = TCPStore(host, port, world_size, True, timeout, multi_tenant=True, master_listen_fd=fd)
        except Exception:
            socket.close(fd)
            raise
    else:
        store = TCPStore(host, port, world_size, False, timeout)
    store.set_timeout(timeout)
    prefixed = PrefixStore(f"tcp://{host}:{port}", store)  # keys of their own, should the store be shared
    group = ProcessGroup(prefixed, rank, world_size)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        impl = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        kind, device = ProcessGroup.BackendType.GLOO, torch.device("cpu")
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        impl = ProcessGroupNCCL(prefixed, rank, world_size, options)
        kind, device = ProcessGroup.BackendType.NCCL, torch.device("cuda")
    else:
        raise ValueError(f"a weight-sync group is 'gloo' or 'nccl', not {backend!r}")
    group._set_default_backend(kind)
    impl._set_sequence_number_for_group()
    group._register_backend(device, kind, impl)
    return group


def close_group(group: ProcessGroup) -> None:
    """End the group's connections: a peer still in a collective with it sees the group end."""
    group.shutdown()
