"""The weight broadcast packs small tensors into one buffer and sends large ones alone: both sides cut the stream
the same way from the tensors' sizes, and the engine side gets every tensor back bit for bit, whatever its dtype.

The round trip runs the trainer's BroadcastSender against the engine worker's WeightReceiver in another process, over
the same stateless gloo group a run uses; only vLLM's reload_weights is replaced by a recorder.
"""

import pickle

import torch
import torch.multiprocessing as mp

from stages.transports.packing import ALIGN, PACK_BELOW, PACK_BYTES, pack, packed, unpack


def test_small_tensors_are_grouped_in_order_and_a_large_one_goes_alone():
    sizes = [10, 20, PACK_BELOW, 30, PACK_BELOW - 1, 40]
    assert list(packed(sizes, lambda n: n)) == [[10, 20], [PACK_BELOW], [30, PACK_BELOW - 1, 40]]
    # A group closes before its aligned layout would pass PACK_BYTES.
    many = [PACK_BELOW - ALIGN] * 20
    groups = list(packed(many, lambda n: n))
    assert sum(groups, []) == many
    assert [len(g) for g in groups] == [PACK_BYTES // (PACK_BELOW - ALIGN), 4]  # 16 fit, then the rest
    assert list(packed([], lambda n: n)) == []


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g),  # 60 bytes: the next offset is not a multiple of 8 without alignment
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.tensor(3.5),  # 0-dim
        torch.arange(5, dtype=torch.int64),
        torch.empty(0, 4),
        torch.randn(PACK_BELOW // 4 + 1, generator=g),  # large: alone
        torch.randn(2, 2, generator=g).to(torch.float16),
    ]


def test_unpack_gives_back_what_pack_laid_out():
    small = [t for t in _tensors() if t.numel() * t.element_size() < PACK_BELOW]
    flat = pack(small, "cpu")
    back = unpack(flat, [list(t.shape) for t in small], [t.dtype for t in small])
    for want, got in zip(small, back, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


class _Recorder:
    """Stands in for vLLM's model runner: keeps a copy of every tensor it is handed."""

    def __init__(self) -> None:
        self.got: dict[str, torch.Tensor] = {}

    def reload_weights(self, weights_iterator) -> None:
        for name, tensor in weights_iterator:
            self.got[name] = tensor.clone()

    def get_model(self) -> torch.nn.Module:
        return torch.nn.Module()


def _engine(port: int, meta: tuple, queue) -> None:
    from stages.engines.vllm_worker import WeightReceiver

    receiver = WeightReceiver()
    receiver.model_runner, receiver.rank = _Recorder(), 0  # the one TP rank of its engine
    receiver.init_weight_group("127.0.0.1", port, 1, 2, "gloo")
    for _ in range(2):  # two pushes: a buffer is not reused under the loader's feet
        receiver.receive_weights(*meta)
        queue.put(pickle.dumps(receiver.model_runner.got))  # by value: a shared tensor dies with this process


def test_a_push_of_mixed_tensors_arrives_whole_at_the_engine():
    from stages.transports.broadcast import BroadcastSender

    tensors = _tensors()
    names = [f"w{i}" for i in range(len(tensors))]
    meta = (names, [list(t.shape) for t in tensors], [str(t.dtype).removeprefix("torch.") for t in tensors])
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    sync = BroadcastSender("gloo")
    engine = ctx.Process(target=_engine, args=(sync.open(2).port, meta, queue))
    engine.start()
    try:
        sync.wait_open()
        for scale in (1, 2):
            scaled = [t * scale if t.is_floating_point() else t for t in tensors]
            sent = sync.send(dict(zip(names, scaled, strict=True)))
            assert sent == sum(t.numel() * t.element_size() for t in tensors)
            got = pickle.loads(queue.get(timeout=60))
            for name, want in zip(names, tensors, strict=True):
                want = want * scale if want.is_floating_point() else want
                assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
                assert torch.equal(got[name], want), name
    finally:
        sync.close()
        engine.join(30)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0


def test_ipc_buckets_hold_up_to_their_bytes_and_a_larger_tensor_alone():
    from stages.transports.ipc import buckets

    assert list(buckets([3, 4, 2, 9, 1, 1], lambda n: n, 8)) == [[3, 4], [2], [9], [1, 1]]
    assert sum(buckets(range(1, 20), lambda n: n, 10), []) == list(range(1, 20))  # in order, none lost
    assert list(buckets([], lambda n: n, 8)) == []
