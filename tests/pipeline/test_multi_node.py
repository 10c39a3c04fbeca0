"""A multi-node Ray cluster on this machine, and a run submitted to it as a Ray Job and placed by ray.placement.

A head and three worker nodes, each a raylet of its own joined to the head (infra/local_cluster.py: join), two marked
`trainer: 1`, one `rollout: 1`. The embedded job, in verl's stream off-policy mode (staleness 0, a sync every 2 steps:
the mode's checks in tests/pipeline/modes.py run on its logs), is submitted to the head's job server (`asyncrl run` as
the Ray Job's entrypoint, this checkout as its working dir): its driver joins that cluster (Ray Jobs hand it the
address), with a data-parallel trainer of two ranks (FSDP2) over two nodes (verl's `trainer.n_gpus_per_node=1
trainer.nnodes=2`), two engine replicas and `ray.placement=required`. Ray's own record of the run's actors (the state
API on the head's dashboard, which reads the GCS and keeps ended actors) says which node ran each: the two trainer ranks
on the two trainer nodes, one each (they meet on rank 0's node address, 127.0.0.1 here), both Generate replicas (which
score, log and split their blocks) and the actor that owns their per-token tables on the rollout node, the version
clock, the staleness gate and the driver's TokenTables on the head. The job succeeds, the run passes its audit, no
server of the cluster listens beyond loopback while it runs, and nothing of the cluster is left once it is stopped.

This test talks to the cluster through its job server and state API only: this pytest process may hold the local Ray of
the other pipeline tests, and a process joins one cluster. The cluster is stopped by its nodes' PIDs
(local_cluster.down), never by `ray stop`, which would end every Ray on the machine.
"""

import json
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from infra import local_cluster as lc
from tests.pipeline.modes import SMALL, check_mode
from tests.pipeline.test_loopback import is_loopback
from tests.waiting import wait_until

HEAD_CPUS = 2  # the gate, the prompt reader
WORKERS = [
    ({"trainer": 1}, 1),
    ({"trainer": 1}, 1),
    ({"rollout": 1}, 3),
]  # (marker, CPUs): a trainer rank each (every trainer node's bundle holds a CPU); 2 engines
SHORT = [*SMALL, "rollout.total_rollout_steps=16"]  # 4 steps of 4 prompts


def state(cluster: lc.Cluster, what: str) -> list[dict]:
    """Rows of Ray's state API (`ray list actors --detail`), read over HTTP from the head's dashboard."""
    url = f"{cluster.dashboard_url}/api/v0/{what}?detail=1&limit=10000"
    with urllib.request.urlopen(urllib.request.Request(url, headers=lc.auth_headers()), timeout=60) as reply:
        return json.loads(reply.read())["data"]["result"]["result"]


def node_kinds(nodes: list[dict]) -> dict[str, str]:
    """node id -> 'head', 'trainer' or 'rollout', from each node's resources."""
    kinds = {}
    for node in nodes:
        marks = [m for m in ("trainer", "rollout") if node["resources_total"].get(m)]
        kinds[node["node_id"]] = "head" if node["is_head_node"] else "+".join(marks) or "unmarked"
    return kinds


def cluster_processes(cluster_dir: Path) -> list[psutil.Process]:
    """Every process of the cluster: its nodes' `ray start` and what they started."""
    cluster = lc.Cluster.load(cluster_dir)
    if cluster is None:
        return []
    procs = []
    for pid in [cluster.pid, *(w.pid for w in cluster.workers)]:
        try:
            node = psutil.Process(pid)
            procs += [node, *node.children(recursive=True)]
        except psutil.Error:
            pass
    return procs


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


def run_job(
    cluster: lc.Cluster, cluster_dir: Path, output_dir: Path, procs: dict[int, psutil.Process]
) -> tuple[str, str, set]:
    """Submit the run as a Ray Job and wait for it: its final status, its log, and every non-loopback server the
    cluster's processes (gathered into `procs` as they come) held while it ran."""
    from ray.job_submission import JobSubmissionClient

    overrides = [
        *SHORT,
        "rollout.num_replicas=2",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=2",
        "actor.fsdp_config.fsdp_size=-1",  # verl's: every trainer rank
        "ray.placement=required",
        "ray.no_progress_timeout_s=600",
        "async_training.trigger_parameter_sync_step=2",  # verl's stream off-policy mode, a sync every 2 steps
        "trainer.monitor=jsonl",
        f"trainer.output_dir={output_dir}",
        "trainer.run_name=placed",
    ]
    client = JobSubmissionClient(cluster.dashboard_url, headers=lc.auth_headers())
    runtime_env = lc.job_runtime_env()
    runtime_env["env_vars"] = {"HF_HUB_OFFLINE": "1"}  # also set by the driver: the job's value must win quietly
    job_id = client.submit_job(
        entrypoint=" ".join(["asyncrl run conf/stream_off_policy.yaml", *overrides]), runtime_env=runtime_env
    )
    exposed: set = set()

    def finished() -> str | None:
        status = client.get_job_status(job_id)
        now = {p.pid: p for p in cluster_processes(cluster_dir)}
        procs.update(now)
        exposed.update(exposed_servers(now))
        return status.value if status.is_terminal() else None

    try:
        status = wait_until(finished, 1500, "the Ray job finished", poll_s=1.0)
    except pytest.fail.Exception:
        client.stop_job(job_id)
        status = "TIMED OUT"
    return status, client.get_job_logs(job_id), exposed


@pytest.mark.slow
@pytest.mark.timeout(1800)  # four nodes' start-up, then the job (up to 1500 s)
def test_a_job_on_a_multi_node_cluster_places_its_actors_and_passes_its_audit(tmp_path):
    cluster_dir = Path(tempfile.mkdtemp(prefix="arp-", dir="/tmp"))  # short: socket paths fit in 107 bytes
    procs: dict[int, psutil.Process] = {}
    timings = {}
    try:
        start = time.monotonic()
        cluster = lc.up(cluster_dir, num_cpus=HEAD_CPUS)
        for marker, cpus in WORKERS:
            lc.join(cluster_dir, marker, num_cpus=cpus)
        timings["cluster_up_s"] = time.monotonic() - start
        start = time.monotonic()
        status, logs, exposed = run_job(cluster, cluster_dir, tmp_path, procs)
        timings["job_s"] = time.monotonic() - start
        assert status == "SUCCEEDED", logs[-6000:]
        assert f"Connecting to existing Ray cluster at address: {cluster.gcs_address}" in logs
        assert not exposed
        actors, kinds = state(cluster, "actors"), node_kinds(state(cluster, "nodes"))
    finally:
        start = time.monotonic()
        lc.down(cluster_dir)
        timings["cluster_down_s"] = time.monotonic() - start
    print(f"placement test: {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    assert not [p for p in procs.values() if p.is_running()]  # is_running also tells a reused PID from ours
    shutil.rmtree(cluster_dir, ignore_errors=True)

    assert sorted(kinds.values()) == ["head", "rollout", "trainer", "trainer"]
    # Ray Data's stage actors are all of class _MapWorker; the stage is in their name, e.g.
    # MapWorker(MapBatches(StalenessGate)).
    where = [(a.get("repr_name") or a["class_name"], kinds.get(a["node_id"], "?")) for a in actors]
    print("placement test: actors and their nodes:", where)
    # Every trainer rank: rank 0 (FSDPTrainer) and its peer (TorchTrainer); Megatron's end in Trainer or Rank too.
    ranks = [a for a in actors if (a.get("repr_name") or a["class_name"]).endswith(("Trainer", "Rank"))]
    assert len({a["node_id"] for a in ranks}) == 2, where  # one rank on each trainer node
    trainer = [kinds.get(a["node_id"], "?") for a in ranks]
    generate = [node for name, node in where if "(ScoredGenerate)" in name]
    tables = sorted(node for name, node in where if name == "TokenTables")
    gate = [node for name, node in where if "(StalenessGate)" in name]
    clock = [node for name, node in where if name == "VersionClock"]
    assert trainer == ["trainer", "trainer"], where
    assert generate == ["rollout", "rollout"], where
    assert tables == ["head", "rollout"], where  # the driver's, and the owner of the tables made beside the engines
    assert gate == clock == ["head"], where

    summary = json.loads((tmp_path / "placed" / "summary.json").read_text())
    assert summary["audit_ok"]
    check_mode(summary, tmp_path / "placed", s=0.0, k=2, prompts=16, per_step=4, n=4)
