"""Each weight transport's sender/receiver pair on its own, without Ray or vLLM: a {name: tensor} dict in on the
trainer's side, a model (or a load_weights callable) updated on the engine's side, in another process over a private
gloo group on loopback; and the store pair through a file. tests/gpu/test_transports_gpu.py drives the CUDA pairs
the same way."""

import multiprocessing as mp

import pytest
import torch

from stages.transports import WeightMeta, loader
from stages.transports.broadcast import BroadcastReceiver, BroadcastSender
from stages.transports.store import StoreReceiver, StoreSender


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 600), torch.nn.LayerNorm(600), torch.nn.Linear(600, 512))
    model.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    return model


def _weights(scale: float) -> dict[str, torch.Tensor]:
    """The model's state, every float tensor scaled: 0.3 MB of small tensors packed together, one of 1.2 MB alone."""
    return {n: t * scale if t.is_floating_point() else t + int(scale) for n, t in _model().state_dict().items()}


def _receive(address, meta: WeightMeta, queue) -> None:
    receiver = BroadcastReceiver("gloo")
    receiver.join(address, 1, 2)
    model = _model()
    for _ in range(2):  # two pushes: each lands whole
        assert receiver.receive(meta, model) == len(meta.names)
        queue.put({n: t.clone() for n, t in model.state_dict().items()})
    got: dict = {}
    receiver.receive(meta, lambda weights: got.update((n, t.clone()) for n, t in weights))  # a load_weights callable
    queue.put(got)
    receiver.close()


def test_a_broadcast_pair_updates_a_model_in_another_process():
    meta = WeightMeta.of(_weights(1))
    sender = BroadcastSender("gloo")
    address = sender.open(2, connect_timeout_s=60)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    engine = ctx.Process(target=_receive, args=(address, meta, queue))
    engine.start()
    try:
        sender.wait_open()
        for scale in (2.0, 3.0, 4.0):
            want = _weights(scale)
            assert sender.send(want) == sum(t.numel() * t.element_size() for t in want.values())
            got = queue.get(timeout=120)
            assert list(got) == list(want)
            for name, tensor in want.items():
                assert torch.equal(got[name], tensor), name
    finally:
        sender.close()
        engine.join(60)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0


def test_the_store_pair_round_trips_through_a_file(tmp_path):
    weights = _weights(5.0)
    weights["tied.weight"] = weights["0.weight"]  # one storage under two names: written as a copy
    url = f"file://{tmp_path}/version-000001.safetensors"
    assert StoreSender().send(weights, url) > 0
    got: dict = {}
    assert StoreReceiver().receive(url, lambda ws: got.update(ws)) == len(weights)
    assert all(torch.equal(got[n], t) for n, t in weights.items())
    model = _model()
    del weights["tied.weight"]
    StoreSender().send(weights, url)
    StoreReceiver().receive(url, model)
    assert torch.equal(model.state_dict()["2.weight"], weights["2.weight"])


def test_a_model_refuses_a_tensor_it_has_no_name_for():
    with pytest.raises(KeyError, match="no parameter or buffer"):
        loader(_model())(iter([("9.weight", torch.zeros(1))]))
