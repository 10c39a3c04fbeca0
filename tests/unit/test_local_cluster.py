"""The local cluster's head command, environment, ports and upload, and `submit`'s config handling.

No Ray is started here; the upload is packed with Ray's own packer.
"""

import os
import zipfile
from pathlib import Path

import pytest

from infra import local_cluster as lc
from pipeline.config import ConfigError


def test_head_listens_on_loopback_with_its_own_ports_and_temp_dir(tmp_path):
    ports = lc.Ports.pick()
    cmd = lc.head_command(Path("/venv/bin/ray"), tmp_path, ports, num_cpus=8)
    assert cmd[:4] == ["/venv/bin/ray", "start", "--head", "--block"]
    assert "--node-ip-address=127.0.0.1" in cmd and "--dashboard-host=127.0.0.1" in cmd
    assert f"--temp-dir={tmp_path}" in cmd and "--num-cpus=8" in cmd
    assert not any("0.0.0.0" in arg for arg in cmd)
    given = {int(arg.rsplit("=", 1)[1]) for arg in cmd if arg.split("=")[0].endswith("-port")}
    assert given == set(vars(ports).values())


def test_ports_are_distinct_and_workers_stay_out_of_the_ephemeral_range():
    ports = lc.Ports.pick()
    single = [v for k, v in vars(ports).items() if not k.endswith("_worker")]
    assert len(set(single)) == len(single)
    assert 20000 <= ports.min_worker < ports.max_worker < 32768
    assert not any(ports.min_worker <= p <= ports.max_worker for p in single)


def test_head_environment_keeps_ray_on_loopback(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    env = lc.head_env()
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0"
    assert env["RAY_AUTH_MODE"] == "token"
    assert "RAY_ADDRESS" not in env
    assert env["PATH"].split(os.pathsep)[0] == str(lc.VENV_BIN)  # the job's `asyncrl` is this venv's


def test_upload_leaves_out_venv_runs_git_and_caches(tmp_path):
    from ray._private.runtime_env.packaging import create_package

    tree = tmp_path / "repo"
    for name in ["pipeline/run.py", ".venv/bin/python", "runs/a/summary.json", ".git/HEAD", "pipeline/__pycache__/x"]:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("x")
    (tree / ".gitignore").write_text((lc.ROOT / ".gitignore").read_text())
    zipped = tmp_path / "pkg.zip"
    create_package(str(tree), zipped, include_gitignore=True, excludes=lc.job_runtime_env(tree)["excludes"])
    files = {n for n in zipfile.ZipFile(zipped).namelist() if not n.endswith("/")}
    assert files == {"pipeline/run.py", ".gitignore"}


def test_submitted_job_writes_outside_the_uploaded_copy():
    config, overrides = lc.job_items(["rollout.n=4"])
    assert config == "conf/default.yaml"  # relative: the job runs in its copy of the working dir
    assert overrides == ["rollout.n=4", f"trainer.output_dir={lc.ROOT / 'runs'}"]
    assert lc.job_items(["conf/on_policy.yaml", "trainer.output_dir=/data/runs"]) == (
        "conf/on_policy.yaml",
        ["trainer.output_dir=/data/runs"],
    )


def test_submit_checks_the_config_before_uploading(tmp_path):
    with pytest.raises(ConfigError, match="Did you mean 'n'"):
        lc.job_items(["rollout.nn=4"])
    outside = tmp_path / "mine.yaml"
    outside.write_text("rollout:\n  n: 2\n")
    with pytest.raises(ValueError, match="not inside"):
        lc.job_items([str(outside)])


def test_down_without_a_cluster_is_a_no_op(tmp_path):
    assert lc.down(tmp_path) is False
    lc.Cluster(pid=os.getpid(), temp_dir=str(tmp_path / "ray"), ports=lc.Ports.pick()).save(tmp_path)
    assert lc.down(tmp_path) is False  # a PID that is not a head started from this directory is left alone
    assert not (tmp_path / "cluster.json").exists()


def test_a_worker_node_joins_on_loopback_with_its_own_ports_marked_with_its_resources(tmp_path):
    import json

    ports = lc.Ports.pick()
    cmd = lc.worker_command(Path("/venv/bin/python"), tmp_path, ports, "127.0.0.1:6390", 2, {"rollout": 1})
    assert cmd[:3] == ["/venv/bin/python", "-m", "infra.worker_node"]
    assert "--address=127.0.0.1:6390" in cmd and '--resources={"rollout": 1}' in cmd
    assert f"--temp-dir={tmp_path}" in cmd and "--num-cpus=2" in cmd
    (given,) = [json.loads(arg.split("=", 1)[1]) for arg in cmd if arg.startswith("--ports=")]
    head_only = {"gcs", "dashboard", "ray_client_server"}
    assert given == {k: v for k, v in vars(ports).items() if k not in head_only}


def test_the_cluster_record_keeps_its_workers(tmp_path):
    cluster = lc.Cluster(123, "/tmp/x", lc.Ports.pick(), (lc.Worker(456, "/tmp/x/w1"),))
    cluster.save(tmp_path)
    assert lc.Cluster.load(tmp_path) == cluster
    assert lc.down(tmp_path) is False  # neither PID is a `ray start` of these temp dirs: nothing is signalled
    assert not (tmp_path / "cluster.json").exists()
