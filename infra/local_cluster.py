"""A Ray cluster on this machine, on loopback only, and Ray Jobs submitted to it.

    python -m infra.local_cluster up [--num-cpus 8] [--port 6390] [--dashboard-port 8365]
    python -m infra.local_cluster join [--num-cpus 2] --resources '{"rollout": 1}'
    python -m infra.local_cluster submit [CONFIG.yaml] [key=value ...]
    python -m infra.local_cluster down

Choices, and why:
- The head is `ray start --head --block` in the background, its PID recorded in the cluster directory. `down`
  sends SIGTERM to that one process, whose own handler stops what it started (GCS, raylet and the workers under
  it, dashboard, agents); on Linux its children also die with it if it is killed. `ray stop` is never used: it
  ends every Ray process on the machine that it may signal, other clusters and other users' runs included.
- Everything listens on 127.0.0.1: `--node-ip-address` and `--dashboard-host`, and Ray's single-machine switch
  (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0) in the head's environment, which every Ray process inherits; without it
  Ray's servers bind every interface.
- Its own `--temp-dir`: `ray start` records its address in `<temp dir>/ray_current_cluster`, and in the default
  /tmp/ray a plain `ray.init()` (`asyncrl run` without a cluster) would find it and join this cluster.
- Every port is chosen here: Ray's defaults (6379, 8265, 10001, 52365, workers 10002-19999) collide with any other
  Ray on the machine, such as the one a test session starts.
- Token authentication on (RAY_AUTH_MODE=token), with the user's Ray token (~/.ray/auth_token, made if missing):
  loopback keeps other machines out, the token keeps out other users of this one, since a job server runs any
  code it is sent. `ray job submit` reads the same token when RAY_AUTH_MODE=token.
- The job runs this venv's `asyncrl`: the venv's bin directory leads the head's PATH, which the driver inherits.
- `join` adds a worker node on this machine (another raylet, infra/worker_node.py, ports and temp dir of its own,
  on loopback too), marked with custom resources such as `{"trainer": 1}`: a multi-node cluster on one machine, for the
  placement of ray.placement (pipeline/config/placement.py). Its PID is recorded beside the head's; `down` stops
  the workers first, the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = Path(tempfile.gettempdir()) / f"asyncrl-cluster-{os.getuid()}"
VENV_BIN = Path(sys.executable).parent
# Ray 2.60 honours .gitignore (venv, runs, caches) and skips .git when it packs a working_dir; the list keeps the
# upload small where either does not hold (no .gitignore, RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1, another Ray).
UPLOAD_EXCLUDES = [".git", ".venv", "runs", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"]
# Outside the ephemeral range (32768-60999), where free_port() and the kernel hand out ports, and above Ray's
# default worker range, so that two clusters on one machine do not share worker ports.
WORKER_PORT_SPAN = (20000, 32000)


@dataclass(frozen=True)
class Ports:
    gcs: int
    dashboard: int
    object_manager: int
    node_manager: int
    ray_client_server: int
    dashboard_agent_listen: int
    dashboard_agent_grpc: int
    runtime_env_agent: int
    metrics_export: int
    min_worker: int
    max_worker: int

    @classmethod
    def pick(cls, gcs: int = 0, dashboard: int = 0, num_worker_ports: int = 200) -> Ports:
        """The given ports, and free loopback ports for the rest (0 means any free one)."""
        held: list[socket.socket] = []  # held open until all are chosen, so no port is chosen twice
        try:
            picked = [_bind(port, held) for port in (gcs, dashboard, 0, 0, 0, 0, 0, 0, 0)]
        finally:
            for s in held:
                s.close()
        low = _free_range(num_worker_ports)
        return cls(*picked, min_worker=low, max_worker=low + num_worker_ports - 1)


def _bind(port: int, held: list[socket.socket]) -> int:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.append(s)
    s.bind(("127.0.0.1", port))
    return s.getsockname()[1]


def _free_range(size: int) -> int:
    for _ in range(50):
        low = random.randrange(WORKER_PORT_SPAN[0], WORKER_PORT_SPAN[1] - size)
        held: list[socket.socket] = []
        try:
            for port in range(low, low + size):
                _bind(port, held)
            return low
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {size} consecutive free ports in {WORKER_PORT_SPAN}")


@dataclass(frozen=True)
class Cluster:
    """What `up` records in the cluster directory, for `submit` and `down`."""

    pid: int
    temp_dir: str
    ports: Ports
    workers: tuple[Worker, ...] = ()

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.dashboard}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.ports.gcs}"

    @staticmethod
    def load(cluster_dir: Path) -> Cluster | None:
        state = cluster_dir / "cluster.json"
        if not state.exists():
            return None
        raw = json.loads(state.read_text())
        workers = tuple(Worker(w["pid"], w["temp_dir"]) for w in raw.get("workers", []))
        return Cluster(raw["pid"], raw["temp_dir"], Ports(**raw["ports"]), workers)

    def save(self, cluster_dir: Path) -> None:
        (cluster_dir / "cluster.json").write_text(json.dumps(asdict(self), indent=2) + "\n")

    def head(self) -> psutil.Process | None:
        """The head's `ray start` process, if it still runs; a PID reused by another process is not ours."""
        return _ours(self.pid, self.temp_dir)


@dataclass(frozen=True)
class Worker:
    """A worker node's process (infra/worker_node.py), as `join` records it."""

    pid: int
    temp_dir: str


def _ours(pid: int, temp_dir: str) -> psutil.Process | None:
    """The node process of that PID if it is the one started with that temp dir."""
    try:
        proc = psutil.Process(pid)
        return proc if f"--temp-dir={temp_dir}" in proc.cmdline() else None
    except psutil.Error:
        return None


def head_command(ray_bin: Path, temp_dir: Path, ports: Ports, num_cpus: int) -> list[str]:
    p = ports
    return [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1",
        "--include-dashboard=true",
        "--disable-usage-stats",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={temp_dir}",
        f"--port={p.gcs}",
        f"--dashboard-port={p.dashboard}",
        f"--object-manager-port={p.object_manager}",
        f"--node-manager-port={p.node_manager}",
        f"--ray-client-server-port={p.ray_client_server}",
        f"--dashboard-agent-listen-port={p.dashboard_agent_listen}",
        f"--dashboard-agent-grpc-port={p.dashboard_agent_grpc}",
        f"--runtime-env-agent-port={p.runtime_env_agent}",
        f"--metrics-export-port={p.metrics_export}",
        f"--min-worker-port={p.min_worker}",
        f"--max-worker-port={p.max_worker}",
    ]


def worker_command(
    python: Path, temp_dir: Path, ports: Ports, gcs_address: str, num_cpus: int, resources: dict[str, float]
) -> list[str]:
    """A worker node of the cluster at gcs_address (infra/worker_node.py: `ray start --address` would leave
    loopback), with the ports a node serves on; the GCS, dashboard and client server are the head's."""
    node_ports = {k: v for k, v in asdict(ports).items() if k not in ("gcs", "dashboard", "ray_client_server")}
    return [
        str(python),
        "-m",
        "infra.worker_node",
        f"--address={gcs_address}",
        f"--temp-dir={temp_dir}",
        f"--num-cpus={num_cpus}",
        f"--resources={json.dumps(resources)}",
        f"--ports={json.dumps(node_ports)}",
    ]


def auth_token() -> str:
    """The user's Ray token, the one `ray start` and Ray's clients read; made on first use."""
    cmd = [str(VENV_BIN / "ray"), "get-auth-token", "--generate"]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


def auth_headers() -> dict[str, str]:
    """For JobSubmissionClient(headers=...) and plain HTTP calls to the job server."""
    return {"Authorization": f"Bearer {auth_token()}"}


def client_env() -> dict[str, str]:
    """The environment of a Ray CLI talking to this cluster: token mode, so it sends the token."""
    return {**os.environ, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "token")}


def head_env() -> dict[str, str]:
    env = {k: v for k, v in client_env().items() if k != "RAY_ADDRESS"}  # a stale address must not steer the head
    env.update(
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        # On SIGTERM the head first drains for up to 30 s so that Serve replicas can finish; nothing here serves.
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        PATH=f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}",
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def up(
    cluster_dir: Path, num_cpus: int = 8, gcs_port: int = 0, dashboard_port: int = 0, timeout_s: float = 180
) -> Cluster:
    """Start the head in the background and return once its job server answers."""
    running = Cluster.load(cluster_dir)
    if running and running.head():
        raise RuntimeError(f"a cluster from {cluster_dir} is already up at {running.dashboard_url}")
    temp_dir = cluster_dir / "ray"
    temp_dir.mkdir(parents=True, exist_ok=True)
    ports = Ports.pick(gcs_port, dashboard_port)
    headers = auth_headers()  # also makes the token before the head looks for it
    cmd = head_command(VENV_BIN / "ray", temp_dir, ports, num_cpus)
    log = cluster_dir / "head.log"
    with log.open("w") as out:
        # Its own session: the head outlives this command and a Ctrl-C in the terminal that started it.
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=head_env(), start_new_session=True
        )
    cluster = Cluster(proc.pid, str(temp_dir), ports)
    cluster.save(cluster_dir)
    try:
        _wait_ready(cluster, proc, log, headers, timeout_s)
    except BaseException:  # also Ctrl-C: a head that never became ready is not left behind
        down(cluster_dir)
        raise
    return cluster


def _wait_ready(cluster: Cluster, proc: subprocess.Popen, log: Path, headers: dict[str, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the head exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            request = urllib.request.Request(f"{cluster.dashboard_url}/api/jobs/", headers=headers)
            with urllib.request.urlopen(request, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"the job server at {cluster.dashboard_url} did not answer within {timeout_s:.0f} s; see {log}")


def join(cluster_dir: Path, resources: dict[str, float], num_cpus: int = 2, timeout_s: float = 180) -> Worker:
    """Start a worker node of the cluster in cluster_dir, on this machine, and return once the GCS has it."""
    cluster = Cluster.load(cluster_dir)
    if cluster is None or cluster.head() is None:
        raise RuntimeError(f"no cluster is up in {cluster_dir}; start its head first (`up`)")
    n = len(cluster.workers) + 1
    temp_dir = cluster_dir / f"w{n}"  # short: Ray's socket paths under it must fit in 107 bytes
    temp_dir.mkdir(parents=True, exist_ok=True)
    cmd = worker_command(Path(sys.executable), temp_dir, Ports.pick(), cluster.gcs_address, num_cpus, resources)
    log = cluster_dir / f"worker-{n}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=head_env(),
            start_new_session=True,
        )
    worker = Worker(proc.pid, str(temp_dir))
    replace(cluster, workers=(*cluster.workers, worker)).save(cluster_dir)
    # The node says so once its raylet is registered with the GCS.
    deadline = time.monotonic() + timeout_s
    while "Ray runtime started" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            down(cluster_dir)
            raise RuntimeError(f"worker node {n} did not start within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return worker


def down(cluster_dir: Path, timeout_s: float = 60) -> bool:
    """Stop the workers and the head recorded in cluster_dir and every process they started; returns whether the head
    was running."""
    cluster = Cluster.load(cluster_dir)
    head = cluster.head() if cluster else None
    for worker in cluster.workers if cluster else ():
        node = _ours(worker.pid, worker.temp_dir)
        if node is not None:
            _stop(node, timeout_s)
    if head is None:
        (cluster_dir / "cluster.json").unlink(missing_ok=True)
        return False
    _stop(head, timeout_s)
    (cluster_dir / "cluster.json").unlink()
    return True


def _stop(node: psutil.Process, timeout_s: float) -> None:
    """SIGTERM to a node's process, whose handler stops what it started; then, by PID, whatever of that is left."""
    started = node.children(recursive=True)  # all ours: the node started them (raylet, GCS, workers, agents)
    node.send_signal(signal.SIGTERM)
    try:
        node.wait(timeout_s)
    except psutil.TimeoutExpired:
        node.kill()
    _, alive = psutil.wait_procs(started, timeout=15)
    for proc in alive:  # only processes of this cluster, by PID
        proc.kill()
    psutil.wait_procs(alive, timeout=5)


def job_runtime_env(working_dir: Path = ROOT) -> dict:
    return {"working_dir": str(working_dir), "excludes": UPLOAD_EXCLUDES}


def submit_command(cluster: Cluster, config: str, overrides: list[str]) -> list[str]:
    """`ray job submit` of `asyncrl run`, which waits for the job and streams its log."""
    env = {"excludes": UPLOAD_EXCLUDES}
    return [
        *(str(VENV_BIN / "ray"), "job", "submit", "--address", cluster.dashboard_url),
        *("--working-dir", str(ROOT), "--runtime-env-json", json.dumps(env)),
        *("--", "asyncrl", "run", config, *overrides),
    ]


def job_items(items: list[str]) -> tuple[str, list[str]]:
    """The config path as the job sees it (relative to the uploaded working dir) and the overrides.

    The job runs in a copy of the working dir inside the cluster's temp dir: a relative trainer.output_dir would
    leave the run there, so runs go to this checkout's runs/ unless trainer.output_dir is given.
    """
    from pipeline.config import DEFAULT_CONFIG, load_config

    config = items[0] if items and "=" not in items[0] else str(DEFAULT_CONFIG)
    overrides = items[1:] if items and "=" not in items[0] else list(items)
    load_config(config, overrides)  # a typo fails here, before anything is uploaded
    try:
        config = str(Path(config).resolve().relative_to(ROOT))
    except ValueError:
        raise ValueError(f"{config} is not inside {ROOT}, the directory uploaded with the job") from None
    if not any(o.startswith("trainer.output_dir=") for o in overrides):
        overrides.append(f"trainer.output_dir={ROOT / 'runs'}")
    return config, overrides


def _submit(cluster_dir: Path, items: list[str]) -> int:
    from pipeline.config import ConfigError

    cluster = Cluster.load(cluster_dir)
    if cluster is None or cluster.head() is None:
        print(f"local_cluster: no cluster is up in {cluster_dir}; run `make cluster-up` first", file=sys.stderr)
        return 2
    try:
        config, overrides = job_items(items)
    except (ConfigError, ValueError) as err:
        print(f"local_cluster: {err}", file=sys.stderr)
        return 2
    cmd = submit_command(cluster, config, overrides)
    print("$", shlex.join(cmd), flush=True)
    return subprocess.call(cmd, env=client_env())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.local_cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="cluster state, logs and Ray's temp dir")
    sub = parser.add_subparsers(dest="command", required=True)
    up_p = sub.add_parser("up", help="start the head on 127.0.0.1")
    up_p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs (ray.num_cpus of a local run)")
    up_p.add_argument("--port", type=int, default=6390, help="GCS port; 0 picks a free one")
    up_p.add_argument("--dashboard-port", type=int, default=8365, help="dashboard and job server; 0 picks one")
    submit_p = sub.add_parser("submit", help="submit `asyncrl run` and stream its log")
    submit_p.add_argument("items", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    join_p = sub.add_parser("join", help="add a worker node on this machine, marked with custom resources")
    join_p.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of the node")
    join_p.add_argument("--resources", type=json.loads, default={}, help="custom resources, e.g. '{\"rollout\": 1}'")
    sub.add_parser("down", help="stop the cluster started from --dir, its workers too")
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = up(args.dir, args.num_cpus, args.port, args.dashboard_port)
        print(f"local_cluster: head pid {cluster.pid}, GCS {cluster.gcs_address}, jobs at {cluster.dashboard_url}")
        print(f"local_cluster: logs in {args.dir}; stop with `make cluster-down`")
        return 0
    if args.command == "submit":
        return _submit(args.dir, args.items)
    if args.command == "join":
        worker = join(args.dir, args.resources, args.num_cpus)
        print(f"local_cluster: worker pid {worker.pid} joined with {args.resources}, {args.num_cpus} CPUs")
        return 0
    stopped = down(args.dir)
    print(f"local_cluster: {'stopped the cluster' if stopped else 'no cluster was up'} in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
