"""Every server a run starts listens on loopback only: Ray's GCS, raylet, workers, and the engines they host."""

import ipaddress

import psutil
import pytest


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
