"""A worker node of the loopback cluster (infra/local_cluster.py: join), kept on 127.0.0.1.

    python -m infra.worker_node --address 127.0.0.1:6390 --temp-dir DIR --num-cpus 2 --resources '{"rollout": 1}' \
        --ports '{...}'

`ray start --address` cannot do this: with Ray's single-machine switch on (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0,
which keeps every server on loopback) it refuses to start a worker node, and with the switch off it turns
127.0.0.1 into the host's routable address and listens there. This starts Ray's Node as `ray start --block` does
(and as Ray's own multi-node test cluster, ray.cluster_utils, does) with the node's address left at 127.0.0.1, then
blocks. SIGTERM stops the node's processes (Node's own handler), as for `ray start --block`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.worker_node", description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's GCS, 127.0.0.1:PORT")
    parser.add_argument("--temp-dir", required=True, help="this node's own temp dir")
    parser.add_argument("--num-cpus", type=int, required=True)
    parser.add_argument("--resources", type=json.loads, default={}, help="custom resources, a JSON object")
    parser.add_argument("--ports", type=json.loads, required=True, help="local_cluster.Ports as a JSON object")
    args = parser.parse_args(argv)

    from stages.ray_internals import worker_node_classes

    Node, RayParams, ensure_token_if_auth_enabled = worker_node_classes()
    p = args.ports
    params = RayParams(
        gcs_address=args.address,
        node_ip_address="127.0.0.1",
        node_name="127.0.0.1",
        num_cpus=args.num_cpus,
        num_gpus=0,
        resources=args.resources,
        temp_dir=args.temp_dir,
        object_manager_port=p["object_manager"],
        node_manager_port=p["node_manager"],
        dashboard_agent_listen_port=p["dashboard_agent_listen"],
        metrics_agent_port=p["dashboard_agent_grpc"],
        runtime_env_agent_port=p["runtime_env_agent"],
        metrics_export_port=p["metrics_export"],
        min_worker_port=p["min_worker"],
        max_worker_port=p["max_worker"],
    )
    ensure_token_if_auth_enabled(None, create_token_if_missing=False)
    # Returns once the raylet is registered with the GCS; on SIGTERM or exit Node stops what it started.
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    print(f"Ray runtime started: worker node {node.node_id} on 127.0.0.1 with {args.resources}", flush=True)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
