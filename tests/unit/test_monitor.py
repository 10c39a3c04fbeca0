"""Monitors against real MLflow stores: a sqlite file in tmp_path and a real `mlflow server` on loopback."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from pipeline.config import ConfigError, load_config
from pipeline.observe.monitor import PARAMS_PER_BATCH, MlflowMonitor, flatten, make_monitor


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path / 'mlflow.db'}"


def log_a_run(uri: str, params: dict[str, str], tmp_path: Path) -> MlflowMonitor:
    monitor = MlflowMonitor(uri, "unit", "r1", params, {"asyncrl.run_dir": str(tmp_path)})
    for step in range(1, 4):
        monitor.log({"reward/mean": step / 10, "timing/train_s": 1.0}, step)
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 3}))
    monitor.log_artifacts([tmp_path / "summary.json"])
    monitor.close("FINISHED")
    return monitor


def test_sqlite_store_params_metrics_artifacts(tmp_path):
    params = {f"p{i:03d}": str(i) for i in range(PARAMS_PER_BATCH + 30)}  # more than one batch
    params["long"] = "x" * 7000  # over MLflow's 6000-character limit
    uri = sqlite_uri(tmp_path / "store")
    monitor = log_a_run(uri, params, tmp_path)

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(monitor.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "r1"
    assert run.data.tags["asyncrl.run_dir"] == str(tmp_path)
    assert len(run.data.params) == len(params)
    assert run.data.params["p129"] == "129" and len(run.data.params["long"]) == 6000
    history = client.get_metric_history(monitor.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [a.path for a in client.list_artifacts(monitor.run_id)] == ["summary.json"]
    # next to the store, not in the current directory
    assert (tmp_path / "store" / "artifacts").is_dir()


def test_failed_run_is_marked_failed(tmp_path):
    uri = sqlite_uri(tmp_path)
    monitor = MlflowMonitor(uri, "unit", "r", {}, {})
    monitor.close("FAILED")
    monitor.close("FINISHED")  # a second close changes nothing
    assert MlflowClient(tracking_uri=uri).get_run(monitor.run_id).info.status == "FAILED"


def test_logging_error_warns_once_and_training_goes_on(tmp_path, capsys):
    uri = sqlite_uri(tmp_path)
    monitor = MlflowMonitor(uri, "unit", "r", {}, {})
    monitor.log({"reward/mean": 0.5}, 1)
    monitor.flush()
    MlflowClient(tracking_uri=uri).delete_run(monitor.run_id)  # e.g. deleted from the UI mid-run
    for step in range(2, 6):
        monitor.log({"reward/mean": 0.5}, step)  # must not raise
    monitor.close("FINISHED")
    err = capsys.readouterr().err
    assert err.count("MLflow logging failed") == 1 and "step 2" in err
    assert monitor.failures == 5  # four steps and the end of the run


@pytest.mark.parametrize(
    "uri", ["nosuchscheme://x", "sqlite:////proc/no/such/dir/mlflow.db", "http://127.0.0.1:{port}"]
)
def test_bad_tracking_uri_fails_at_start_naming_the_key(uri):
    uri = uri.format(port=free_port())  # nothing listens there
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"trainer\.mlflow_tracking_uri"):
        MlflowMonitor(uri, "unit", "r", {}, {})
    assert time.monotonic() - start < 20  # no minutes of retries


def test_default_store_lives_in_the_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # artifacts must not land in the current directory
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("a: 1\n")
    cfg = load_config(None, ["trainer.run_name=r", "async_training.staleness_threshold=0.25"])
    monitor = make_monitor(cfg, run_dir)
    monitor.log({"reward/mean": 1.0}, 1)
    monitor.close("FINISHED")

    assert json.loads((run_dir / "metrics.jsonl").read_text()) == {"step": 1, "reward/mean": 1.0}
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("asyncrl").experiment_id])
    assert run.data.params["async_training.staleness_threshold"] == "0.25"
    assert run.data.params["stages.reward._target_"] == "stages.reward.Reward"
    assert run.data.tags["asyncrl.sample_log"] == str(run_dir / "samples")
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["config.yaml"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_jsonl_only_needs_no_mlflow_store(tmp_path):
    monitor = make_monitor(load_config(None, ["trainer.monitor=jsonl"]), tmp_path)
    monitor.log({"reward/mean": 1.0}, 1)
    monitor.close("FINISHED")
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "mlflow").exists()


def test_monitor_lists_and_typos():
    assert load_config(None, ["trainer.monitor=[mlflow,jsonl]"]).trainer.monitor == ["mlflow", "jsonl"]
    with pytest.raises(ConfigError, match="trainer.monitor 'mlfow'"):
        load_config(None, ["trainer.monitor=mlfow"])


def test_flatten():
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": "x"}) == {"a.b": "1", "a.c": "[1, 2]", "d": "x"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_against_a_real_mlflow_server(tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", sqlite_uri(tmp_path), "--artifacts-destination", str(tmp_path / "artifacts")]
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    # Tracking only: without its job runner (a handful of worker processes) the server starts in half the time.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    # Own session: the server starts a uvicorn process; the group of this process (its id) is stopped below.
    # Healthy after ~8 s on an idle machine, much later on a busy one: hence wait_healthy's generous timeout.
    server = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(uri, server, tmp_path / "server.log")
        monitor = log_a_run(uri, {"async_training.staleness_threshold": "0.5"}, tmp_path)
        client = MlflowClient(tracking_uri=uri)
        run = client.get_run(monitor.run_id)
        assert run.info.status == "FINISHED"
        assert run.data.params == {"async_training.staleness_threshold": "0.5"}
        assert len(client.get_metric_history(monitor.run_id, "reward/mean")) == 3
        assert [a.path for a in client.list_artifacts(monitor.run_id)] == ["summary.json"]
        assert list((tmp_path / "artifacts").rglob("summary.json"))  # the server stored it
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()


def wait_healthy(uri: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"mlflow server exited with {server.returncode}: {log.read_text()[-2000:]}")
        try:
            if requests.get(f"{uri}/health", timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {timeout_s}s: {log.read_text()[-2000:]}")
