"""Monitors against real MLflow stores: a sqlite file in tmp_path and a real `mlflow server` on loopback."""

import contextlib
import io
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
from tests.waiting import wait_until


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
    with socket.socket() as held:  # a port bound here and never listened on: nothing can listen there meanwhile
        held.bind(("127.0.0.1", 0))
        uri = uri.format(port=held.getsockname()[1])
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


def start_server(tmp_path: Path, attempts: int = 3) -> tuple[subprocess.Popen, str]:
    """An mlflow server on a free loopback port and its URI. The port is free when chosen and bound by the server
    a moment later: should another process take it meanwhile, the server exits and another port is tried."""
    # Tracking only: without its job runner (a handful of worker processes) the server starts in half the time.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    for attempt in range(attempts):
        port = free_port()
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        cmd += ["--backend-store-uri", sqlite_uri(tmp_path), "--artifacts-destination", str(tmp_path / "artifacts")]
        log_path = tmp_path / f"server-{attempt}.log"
        with open(log_path, "wb") as log:
            # Own session: the server starts a uvicorn process; the group of this process (its id) is stopped at the
            # end. Healthy after ~8 s on an idle machine, much later on a busy one: hence the generous timeout.
            server = subprocess.Popen(
                cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        uri = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(uri, server, log_path)
            return server, uri
        except pytest.fail.Exception:
            if server.poll() is None or "address already in use" not in log_path.read_text().lower():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, signal.SIGTERM)
                raise
    pytest.fail(f"no free port for an mlflow server in {attempts} attempts")


@pytest.mark.timeout(300)  # the server's start: seconds on an idle machine, minutes on a loaded one
def test_against_a_real_mlflow_server(tmp_path):
    server, uri = start_server(tmp_path)
    try:
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


def wait_healthy(uri: str, server: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    def healthy() -> bool:
        try:
            return requests.get(f"{uri}/health", timeout=2).ok
        except requests.ConnectionError:
            return False

    def exited() -> str | None:
        return None if server.poll() is None else f"exited with {server.returncode}: {log.read_text()[-2000:]}"

    wait_until(healthy, timeout_s, "the mlflow server healthy", poll_s=0.5, give_up=exited)


class _Log(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_console_writes_a_line_every_interval_where_stderr_is_a_log_and_nothing_on_a_terminal():
    from pipeline.observe.monitor import ConsoleMonitor

    log = _Log(tty=False)
    console = ConsoleMonitor(total_steps=5, interval=2, stream=log)
    for step in range(1, 6):
        console.log({"reward/mean": 0.5 + step / 10, "actor/pg_loss": -0.1, "other": 1.0}, step)
    lines = log.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == ["2/5", "4/5", "5/5"]  # every 2nd step, and the last
    assert "reward/mean=0.7" in lines[0] and "other" not in lines[0] and "\r" not in log.getvalue()
    terminal = _Log(tty=True)
    ConsoleMonitor(5, 1, terminal).log({"reward/mean": 1.0}, 1)
    assert terminal.getvalue() == ""  # the progress bar shows it there


def test_tensorboard_writes_every_metric_as_a_scalar(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from pipeline.observe.monitor import TensorBoardMonitor

    board = TensorBoardMonitor(tmp_path / "tensorboard")
    board.log({"reward/mean": 0.25}, 1)
    board.log({"reward/mean": 0.75}, 2)
    board.close("FINISHED")
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]


def test_a_monitor_whose_package_is_missing_is_named_at_load(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="tensorboard package is not installed"):
        load_config(None, ["trainer.logger=[console,tensorboard]"])


def test_a_metric_name_mlflow_refuses_is_logged_under_a_name_it_takes(tmp_path):
    uri = sqlite_uri(tmp_path)
    monitor = MlflowMonitor(uri, "unit", "r", {}, {})
    monitor.log({"val/reverse/reward/mean@4": 0.5, "reward/mean": 0.25}, 1)
    monitor.close("FINISHED")
    assert monitor.failures == 0
    got = MlflowClient(tracking_uri=uri).get_run(monitor.run_id).data.metrics
    assert got == {"val/reverse/reward/mean_4": 0.5, "reward/mean": 0.25}
