"""A short run submitted as a Ray job to a cluster of its own (`ray start --head` on loopback): the driver joins
that cluster, the run passes its audit, and no server of that cluster listens beyond loopback.

The cluster has its own temp dir and ports, so it lives beside the Ray that other pipeline tests start in this
process; this test talks to it through the job server only and never calls ray.init. It is stopped by its head's
PID (infra/local_cluster.py: down), never by `ray stop`, which would end every Ray on the machine.
"""

import json
import shutil
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from infra import local_cluster as lc
from tests.pipeline.test_loopback import is_loopback
from tests.pipeline.test_modes import SMALL


def name_of(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:  # it ended since it was listed
        return "?"


def exposed_servers(procs: dict[int, psutil.Process]) -> set[tuple[str, int, str]]:
    """Listening sockets of these processes that are not on loopback."""
    found = set()
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.pid in procs and not is_loopback(c.laddr.ip):
            found.add((c.laddr.ip, c.laddr.port, name_of(procs[c.pid])))
    return found


def wait_for(client, job_id: str, head_pid: int, timeout_s: float) -> tuple[str, set, list[psutil.Process]]:
    """The job's final status, every non-loopback server seen while it ran, and every process of the cluster."""
    exposed: set = set()
    seen: dict[int, psutil.Process] = {}
    head = psutil.Process(head_pid)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status.value, exposed, list(seen.values())
        now = {p.pid: p for p in [head, *head.children(recursive=True)]}
        seen.update(now)
        exposed |= exposed_servers(now)
        time.sleep(3)
    client.stop_job(job_id)
    return "TIMED OUT", exposed, list(seen.values())


@pytest.mark.slow
def test_job_on_a_loopback_cluster_joins_it_and_passes_its_audit(tmp_path):
    from ray.job_submission import JobSubmissionClient

    # Short: Ray's socket paths under the temp dir must fit in 107 bytes.
    cluster_dir = Path(tempfile.mkdtemp(prefix="arj-", dir="/tmp"))
    try:
        cluster = lc.up(cluster_dir, num_cpus=8)
        client = JobSubmissionClient(cluster.dashboard_url, headers=lc.auth_headers())
        overrides = [*SMALL, f"trainer.output_dir={tmp_path}", "trainer.run_name=job", "ray.no_progress_timeout_s=600"]
        runtime_env = lc.job_runtime_env()
        runtime_env["env_vars"] = {"HF_HUB_OFFLINE": "1"}  # also set by the driver: the job's value must win quietly
        entrypoint = " ".join(["asyncrl run conf/default.yaml", *overrides])
        job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        status, exposed, procs = wait_for(client, job_id, cluster.pid, timeout_s=1200)
        logs = client.get_job_logs(job_id)
        assert status == "SUCCEEDED", logs[-6000:]
        assert f"Connecting to existing Ray cluster at address: {cluster.gcs_address}" in logs
        assert not exposed
    finally:
        lc.down(cluster_dir)
    assert not [p for p in procs if p.is_running()]  # is_running also tells a reused PID from ours
    shutil.rmtree(cluster_dir, ignore_errors=True)

    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert summary["audit_ok"]
    assert summary["steps"] == 8  # 34 prompts at 4 per step
