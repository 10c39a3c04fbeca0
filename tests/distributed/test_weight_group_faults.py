"""A receiver of the weight broadcast dies in the middle of a push: the trainer's push fails at once, its group is
closed, the surviving receiver's receive ends within seconds instead of waiting out the group's 600 s timeout, and
a group formed again with the survivor carries the whole push (pipeline/sync.py repeats it that way).

Three processes on loopback with the same stateless gloo groups the run uses (stages/transports/broadcast.py's sender on
the trainer side, the stateless init its receiver uses on the receivers' side).
"""

import os
import signal
import time

import torch
import torch.multiprocessing as mp

TENSORS = 400  # 400 x 1 MiB: a push long enough to be cut in the middle


def _receiver(rank: int, world: int, port: int, queue, ports=None) -> None:
    import torch.distributed as dist
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    group = stateless_init_torch_distributed_process_group("127.0.0.1", port, rank, world, backend="gloo")
    received, start = 0, time.monotonic()
    try:
        for _ in range(TENSORS):
            dist.broadcast(torch.empty(1 << 18), group=group, group_src=0)
            received += 1
            queue.put(("got", rank, received))
    except Exception as err:  # noqa: BLE001 - the receive ending is what this test waits for
        queue.put(("ended", rank, received, time.monotonic() - start, type(err).__name__))
    if ports is not None:  # the group formed again, without the dead receiver
        group = stateless_init_torch_distributed_process_group("127.0.0.1", ports.get(), 1, 2, backend="gloo")
        tensors = [torch.empty(1 << 18) for _ in range(TENSORS)]
        for t in tensors:
            dist.broadcast(t, group=group, group_src=0)
        queue.put(("again", rank, sum(float(t[0]) for t in tensors)))


def _next(queue, kind: str, rank: int, timeout_s: float = 60.0) -> tuple:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if msg[0] == kind and msg[1] == rank:
            return msg
    raise TimeoutError(f"no {kind} from rank {rank}")


def test_a_receiver_dying_mid_push_ends_the_push_and_the_survivors_receive_at_once():
    from stages.transports.broadcast import BroadcastSender

    ctx = mp.get_context("spawn")
    queue, ports = ctx.Queue(), ctx.Queue()
    sync = BroadcastSender("gloo")
    group = sync.open(3)
    survivor = ctx.Process(target=_receiver, args=(1, 3, group.port, queue, ports))
    doomed = ctx.Process(target=_receiver, args=(2, 3, group.port, queue))
    survivor.start()
    doomed.start()
    sync.wait_open()
    try:
        tensors = (torch.full((1 << 18,), float(i)) for i in range(TENSORS))

        def cut(ts):
            for i, t in enumerate(ts):
                if i == 20:  # the doomed receiver has taken some of the push: kill it in the middle
                    _next(queue, "got", 2)
                    os.kill(doomed.pid, signal.SIGKILL)
                yield str(i), t

        start, kept = time.monotonic(), []
        try:
            sync.send(cut(tensors))
            raise AssertionError("the push went through although a receiver died in the middle of it")
        except RuntimeError as err:
            kept.append(err)  # the error kept, as a Ray actor keeps a failed task's while it reports it
        assert time.monotonic() - start < 30, "the trainer waited for the dead receiver"
        assert sync.group is None  # closed: the next open forms a new group
        ended = _next(queue, "ended", 1, timeout_s=30)
        assert ended[2] < TENSORS and ended[3] < 60, ended  # the survivor's receive ended within seconds

        ports.put(sync.open(2).port)  # formed again with the survivor: the whole push goes through
        sync.wait_open()
        sync.send((str(i), torch.full((1 << 18,), float(i))) for i in range(TENSORS))
        assert _next(queue, "again", 1)[2] == TENSORS * (TENSORS - 1) / 2
    finally:
        sync.close()
        for proc in (doomed, survivor):
            proc.join(20)
            if proc.is_alive():
                proc.kill()
    assert survivor.exitcode == 0


CONNECT_S = 8.0  # the rendezvous timeout of the test below (a run's default is weight_sync.connect_timeout_s)


def _joiner(ports, queue) -> None:
    """A receiver joining the groups the trainer offers (port, rank, world) until one forms, as a replica does
    with each init_group message; then it receives one tensor."""
    from datetime import timedelta

    import torch.distributed as dist
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    from stages.transports import OP_TIMEOUT

    queue.put(("ready", 1))
    while True:
        port, rank, world = ports.get()
        start = time.monotonic()
        try:
            group = stateless_init_torch_distributed_process_group(
                "127.0.0.1", port, rank, world, backend="gloo", timeout=timedelta(seconds=CONNECT_S)
            )
        except Exception:  # noqa: BLE001 - a member never joined: wait for the next offer
            queue.put(("gave_up", 1, time.monotonic() - start))
            continue
        group.set_timeout(OP_TIMEOUT)
        tensor = torch.zeros(4)
        dist.broadcast(tensor, group=group, group_src=0)
        queue.put(("again", 1, float(tensor.sum())))
        return


def test_a_receiver_dying_while_the_group_forms_costs_one_short_timeout_not_600_s():
    """The trainer and the live receiver give up on a group whose third member never joins after the rendezvous
    timeout; the group formed again without it carries a push, and a broadcast in it may wait longer than that
    timeout (the engines drain before they receive)."""
    from stages.transports.broadcast import BroadcastSender

    ctx = mp.get_context("spawn")
    queue, ports = ctx.Queue(), ctx.Queue()
    survivor = ctx.Process(target=_joiner, args=(ports, queue))
    survivor.start()
    sync = BroadcastSender("gloo")
    try:
        _next(queue, "ready", 1)
        start = time.monotonic()
        ports.put((sync.open(3, CONNECT_S).port, 1, 3))  # rank 2 died before it joined
        try:
            sync.wait_open()
            raise AssertionError("a group formed without one of its members")
        except RuntimeError:
            pass
        trainer_gave_up = time.monotonic() - start
        assert CONNECT_S - 1 < trainer_gave_up < 3 * CONNECT_S, trainer_gave_up
        assert _next(queue, "gave_up", 1)[2] < 3 * CONNECT_S

        ports.put((sync.open(2, CONNECT_S).port, 1, 2))  # formed again with the live receiver only
        sync.wait_open()
        time.sleep(CONNECT_S + 2)  # longer than the rendezvous timeout: a collective is not held to it
        sync.send({"w": torch.full((4,), 2.0)})
        assert _next(queue, "again", 1)[2] == 8.0
    finally:
        sync.close()
        survivor.join(20)
        if survivor.is_alive():
            survivor.kill()
    assert survivor.exitcode == 0
