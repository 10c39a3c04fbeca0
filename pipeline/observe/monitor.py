"""Monitors: where the driver sends metrics. Stages never log; they emit measurement columns.

`Monitor` is the swap point. `metrics.jsonl` in the run directory is written in every case: it is the run's own
record, which the summary is computed from, like the sample logs. `trainer.monitor` (verl: trainer.logger) adds the
console (a line per step in logs), MLflow (both the default) and TensorBoard.

MLflow gets, per run: the flattened resolved config as params, every step's metrics (one `log_batch` per step),
`config.yaml` at the start and `summary.json` and `audit.txt` at the end as artifacts, and tags naming the run
directory and its sample logs, which MLflow does not copy (they can be large; the notebook reads them in place).
An empty `trainer.mlflow_tracking_uri` keeps everything inside the run directory (a sqlite store), so a run needs
no server. A tracking store that cannot be reached fails the run at start-up; an MLflow error during training only
warns once, because losing a long run to a flaky tracking server is worse than a gap in its charts.

MLflow's calls during the run go through one writer thread of their own, in order: a Ctrl-C (a KeyboardInterrupt in
the driver's main thread) then never lands inside one of them, where it would leave a sqlite store's write lock held
by a transaction nobody ends, and the run's KILLED status could not be written.
"""

from __future__ import annotations

import json
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, Protocol

from omegaconf import OmegaConf

from pipeline.config import ConfigError, RunConfig, monitor_names

# MLflow's limits: a param value holds at most 6000 characters, and one log_batch at most 100 params.
MAX_PARAM_CHARS = 6000
PARAMS_PER_BATCH = 100
# How long closing waits for the writer thread to send what is queued (a hung server must not hang the driver).
CLOSE_TIMEOUT_S = 60.0


RunStatus = Literal["FINISHED", "FAILED", "KILLED"]  # MLflow's names for how a run ended


class Monitor(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifacts(self, paths: Iterable[Path]) -> None: ...

    def close(self, status: RunStatus) -> None:
        """End the run as FINISHED, FAILED or KILLED (interrupted by the user). Closing twice is a no-op."""


class JsonlMonitor:
    """One JSON object per step in `metrics.jsonl`, flushed as it goes so a crashed run keeps its history."""

    def __init__(self, run_dir: Path) -> None:
        self.file = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        pass  # the files already live in the run directory

    def close(self, status: RunStatus) -> None:
        self.file.close()


class MlflowMonitor:
    """One MLflow run per asyncrl run, through `MlflowClient` (no global `mlflow.set_tracking_uri`)."""

    def __init__(
        self, tracking_uri: str, experiment_name: str, run_name: str, params: dict[str, str], tags: dict[str, str]
    ) -> None:
        from mlflow import MlflowClient

        self.tracking_uri = tracking_uri
        self.failures = 0
        self.closed = False
        try:
            _check_reachable(tracking_uri)
            self.client = MlflowClient(tracking_uri=tracking_uri)
            experiment_id = self._experiment(experiment_name)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
            self.log_params(params)
        except Exception as err:  # any failure here means the store is unusable: say which key to fix
            raise ConfigError(
                f"trainer.mlflow_tracking_uri {tracking_uri!r}: MLflow cannot use this tracking store "
                f"({type(err).__name__}: {str(err)[:300]}). Give an http(s):// URL of a running `mlflow server`, "
                f"a sqlite:///path/to/mlflow.db, or leave it empty for a store inside the run directory; "
                f"or set trainer.monitor=jsonl."
            ) from err
        self._calls: queue.Queue[tuple[str, Callable[..., Any], tuple] | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write, name="mlflow-writer", daemon=True)
        self._writer.start()

    def _experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name, artifact_location=artifact_location(self.tracking_uri))
        except MlflowException:  # another run on a shared store may have created it since the lookup
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in params.items()]
        for i in range(0, len(items), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + PARAMS_PER_BATCH])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        batch = [Metric(mlflow_name(key), float(value), now_ms, step) for key, value in metrics.items()]
        self._calls.put((f"step {step}", self.client.log_batch, (self.run_id, batch)))

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        for path in paths:
            if Path(path).exists():
                self._calls.put((Path(path).name, self.client.log_artifact, (self.run_id, str(path))))

    def close(self, status: RunStatus) -> None:
        if self.closed:
            return
        self.closed = True
        self._calls.put(("end of run", self.client.set_terminated, (self.run_id, status)))
        self._calls.put(None)
        self._writer.join(CLOSE_TIMEOUT_S)
        if self._writer.is_alive():
            print(
                f"asyncrl: warning: MLflow did not take the run's last calls in {CLOSE_TIMEOUT_S:.0f} s",
                file=sys.stderr,
            )
        if self.failures:
            print(f"asyncrl: {self.failures} MLflow call(s) failed in this run; metrics.jsonl is complete", flush=True)

    def flush(self) -> None:
        """Return once every call queued so far has been made (or has failed and been counted)."""
        self._calls.join()

    def _write(self) -> None:
        """The writer thread: every queued call in order, until close()'s end marker."""
        while (item := self._calls.get()) is not None:
            what, call, args = item
            try:
                self._tolerant(what, call, *args)
            finally:
                self._calls.task_done()
        self._calls.task_done()

    def _tolerant(self, what: str, call: Callable[..., Any], *args: Any) -> None:
        try:
            call(*args)
        except Exception as err:
            self.failures += 1
            if self.failures == 1:
                print(
                    f"asyncrl: warning: MLflow logging failed at {what} ({type(err).__name__}: {str(err)[:200]}); "
                    f"training goes on, metrics.jsonl keeps every step, further MLflow errors are only counted",
                    file=sys.stderr,
                    flush=True,
                )


class ConsoleMonitor:
    """verl's console logger, made for logs: where stderr is not a terminal (a Ray job's log, CI) the driver's progress
    bar is off (pipeline/run.py) and this writes one line of the main metrics every `interval` steps; on a terminal
    the bar shows progress and this stays quiet."""

    KEYS = ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "staleness/max_lag")

    def __init__(self, total_steps: int, interval: int = 1, stream=None) -> None:
        self.total, self.interval, self.stream = total_steps, interval, stream or sys.stderr
        self.quiet = self.stream.isatty()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.quiet or (step % self.interval and step != self.total):
            return
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in self.KEYS if k in metrics)
        elapsed = metrics.get("timing/elapsed_s")
        clock = f" elapsed={elapsed:.0f}s" if elapsed is not None else ""
        print(f"asyncrl: step {step}/{self.total} {shown}{clock}", file=self.stream, flush=True)

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        pass

    def close(self, status: RunStatus) -> None:
        pass


class TensorBoardMonitor:
    """Every step's metrics as TensorBoard scalars in `log_dir` (torch's SummaryWriter; the tensorboard package)."""

    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, float(value), step)
        self.writer.flush()

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        pass

    def close(self, status: RunStatus) -> None:
        self.writer.close()


def _prompts_per_step(cfg: RunConfig) -> int:
    return cfg.async_training.require_batches * cfg.actor.ppo_mini_batch_size


class Monitors:
    """Fan-out to several monitors, in order."""

    def __init__(self, monitors: list[Monitor]) -> None:
        self.monitors = monitors

    def log(self, metrics: dict[str, float], step: int) -> None:
        for m in self.monitors:
            m.log(metrics, step)

    def log_artifacts(self, paths: Iterable[Path]) -> None:
        paths = list(paths)
        for m in self.monitors:
            m.log_artifacts(paths)

    def close(self, status: RunStatus) -> None:
        for m in self.monitors:
            m.close(status)


def mlflow_name(key: str) -> str:
    """A metric's name as MLflow accepts it: verl's `@` (`val/reverse/reward/mean@4`) and any other character outside
    MLflow's alphanumerics, `_ - . : /` and space become `_` (metrics.jsonl keeps the name as it is)."""
    return re.sub(r"[^\w\-. :/]", "_", key)


def flatten(node: Any, prefix: str = "") -> dict[str, str]:
    """Nested config -> {'async_training.staleness_threshold': '0.5', ...}; lists stay one value."""
    if not isinstance(node, dict):
        return {prefix: str(node)}
    flat: dict[str, str] = {}
    for key, value in node.items():
        flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def resolve_tracking_uri(cfg_uri: str, run_dir: Path) -> str:
    return cfg_uri or f"sqlite:///{(Path(run_dir) / 'mlflow' / 'mlflow.db').resolve()}"


def artifact_location(uri: str) -> str | None:
    """Next to a sqlite store (MLflow's default is ./mlruns in the current directory); a server decides its own."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "artifacts").resolve().as_uri()
    return None


def _check_reachable(uri: str) -> None:
    """An unreachable server would make MLflow retry for minutes; a health probe fails in seconds."""
    if uri.startswith(("http://", "https://")):
        import requests

        requests.get(uri.rstrip("/") + "/health", timeout=10).raise_for_status()
    elif uri.startswith("sqlite:///"):
        Path(uri[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)


def run_tags(run_dir: Path) -> dict[str, str]:
    run_dir = Path(run_dir).resolve()
    return {
        "asyncrl.run_dir": str(run_dir),
        "asyncrl.sample_log": str(run_dir / "samples"),
        "asyncrl.consumed_log": str(run_dir / "consumed"),
        "mlflow.note.content": f"Sample logs: {run_dir / 'samples'}. To inspect them: "
        f"open notebooks/inspect_samples.ipynb with ASYNCRL_RUN_DIR={run_dir}",
    }


def make_monitor(cfg: RunConfig, run_dir: Path) -> Monitor:
    """metrics.jsonl always; the console, TensorBoard and MLflow too when `trainer.monitor` names them (MLflow's
    store checked here, before any model or Ray)."""
    t = cfg.trainer
    names = monitor_names(t.monitor)
    monitors: list[Monitor] = []
    if "console" in names:
        monitors.append(ConsoleMonitor(cfg.rollout.total_rollout_steps // _prompts_per_step(cfg), t.console_interval))
    if "tensorboard" in names:
        monitors.append(TensorBoardMonitor(Path(run_dir) / "tensorboard"))
    if "mlflow" in names:
        params = flatten(OmegaConf.to_container(OmegaConf.structured(cfg)))
        uri = resolve_tracking_uri(t.mlflow_tracking_uri, run_dir)
        mlflow = MlflowMonitor(uri, t.project_name, Path(run_dir).name, params, run_tags(run_dir))
        mlflow.log_artifacts([Path(run_dir) / "config.yaml"])
        monitors.append(mlflow)
    return Monitors([JsonlMonitor(run_dir), *monitors])
