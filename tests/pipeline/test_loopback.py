"""Every server a run starts listens on loopback only: Ray's GCS, raylet, workers, and the engines they host; and
what a run started in a Ray session that outlives it ends with the run."""

import ipaddress

import psutil
import pytest

from tests.waiting import wait_until


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # '::ffff:127.0.0.1' is IPv4 loopback seen by an IPv6 socket
    return (mapped or addr).is_loopback


@pytest.mark.slow
def test_everything_we_started_listens_on_loopback(partial_run):
    # After the shared partial-rollout run (conftest): Ray's servers, its workers and whatever the run left up.
    import ray

    assert ray.util.get_node_ip_address() == "127.0.0.1"
    ours = {p.pid for p in psutil.Process().children(recursive=True)} | {psutil.Process().pid}
    listening = [c for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN and c.pid in ours]
    assert listening, "expected Ray's servers among our descendants"
    exposed = [
        (c.laddr.ip, c.laddr.port, psutil.Process(c.pid).name()) for c in listening if not is_loopback(c.laddr.ip)
    ]
    assert not exposed


@pytest.mark.slow
def test_the_streams_actors_and_engines_end_with_the_run(partial_run):
    # The shared run scored in its engine's actor; the Ray session (pytest's) lives on. A stage actor left alive
    # keeps its vLLM processes, which spin: each later run of the session would be slower. The run's TokenTables
    # (holding the tables of prompts still in flight at its end) go with the stream.
    def left() -> list[str]:
        names = []
        for proc in psutil.Process().children(recursive=True):
            try:
                cmdline = " ".join(proc.cmdline())
            except psutil.Error:
                continue
            ours = ("MapWorker(", "ray::TokenTables", "VLLM::")
            if any(k in cmdline for k in ours) or proc.name().startswith("VLLM"):
                names.append(cmdline[:60] or proc.name())
        return names

    # the kill reaches the processes in a moment
    wait_until(lambda: not left(), 30, lambda: f"the shared run's processes still running: {left()}", poll_s=0.5)
