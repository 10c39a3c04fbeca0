"""The CUDA weight transports' pairs on their own, without Ray or vLLM (torch alone): CUDA IPC between two processes
on one GPU, and the NCCL broadcast between two GPUs. The trainer's side sends a {name: tensor} dict of CUDA tensors;
the engine's side updates a model on its GPU (or hands the tensors to a load_weights callable), and every tensor
must arrive bit for bit, push after push. tests/distributed/test_transports.py is the gloo counterpart."""

import multiprocessing as mp

import pytest
import torch

from stages.transports import WeightMeta
from stages.transports.broadcast import BroadcastReceiver, BroadcastSender
from stages.transports.ipc import IpcReceiver, IpcSender

pytestmark = pytest.mark.gpu


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 512))
    return model.to(device=device, dtype=torch.bfloat16)


def _weights(scale: float, device: str) -> dict[str, torch.Tensor]:
    return {n: t * scale for n, t in _model(device).state_dict().items()}


def _receive(kind: str, address, meta: WeightMeta, device: str, pushes: int, queue) -> None:
    torch.cuda.set_device(torch.device(device))
    receiver = IpcReceiver() if kind == "ipc" else BroadcastReceiver("nccl")
    receiver.join(address, 1, 2)
    model = _model(device)
    for _ in range(pushes):
        assert receiver.receive(meta, model) == len(meta.names)
        queue.put({n: t.cpu() for n, t in model.state_dict().items()})
    got: dict = {}
    receiver.receive(meta, lambda weights: got.update((n, t.cpu()) for n, t in weights))
    queue.put(got)
    receiver.close()


def _round_trip(kind: str, sender, engine_device: str) -> None:
    pushes = 3
    meta = WeightMeta.of(_weights(1.0, "cuda:0"))
    address = sender.open(2, connect_timeout_s=120)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    engine = ctx.Process(target=_receive, args=(kind, address, meta, engine_device, pushes, queue))
    engine.start()
    try:
        sender.wait_open()
        for scale in [float(s) for s in range(2, pushes + 3)]:
            want = _weights(scale, "cuda:0")
            assert sender.send(want) == sum(t.numel() * t.element_size() for t in want.values())
            got = queue.get(timeout=300)
            assert list(got) == list(want)
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor.cpu()), (kind, scale, name)
    finally:
        sender.close()
        engine.join(60)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0


def test_cuda_ipc_pair_on_one_gpu():
    torch.cuda.set_device(0)
    _round_trip("ipc", IpcSender("127.0.0.1"), "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL places each rank on a GPU of its own: needs two")
def test_nccl_broadcast_pair_on_two_gpus():
    torch.cuda.set_device(0)
    _round_trip("nccl", BroadcastSender("nccl", "127.0.0.1"), "cuda:1")
