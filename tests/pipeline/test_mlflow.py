"""A real run in MLflow: read back with MlflowClient from the sqlite store the run keeps in its own directory."""

import json

import pytest
from mlflow import MlflowClient

from pipeline.observe.monitor import mlflow_name


@pytest.mark.slow
def test_run_is_logged_to_mlflow(partial_run, tmp_path):
    summary, run_dir = partial_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("asyncrl").experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "partial"
    assert run.info.artifact_uri.startswith((run_dir / "mlflow" / "artifacts").as_uri())

    # the resolved config, flattened
    params = run.data.params
    assert params["async_training.staleness_threshold"] == "0.5"
    assert params["async_training.partial_rollout"] == "True"
    assert params["rollout.n"] == "4" and "mlflow" in params["trainer.monitor"]  # with the console by default
    assert params["stages.generate._target_"] == "stages.generate.VLLMGenerate"

    # one point per step, the same values as metrics.jsonl
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    history = client.get_metric_history(run_id, "reward/mean")
    assert [m.step for m in history] == list(range(1, summary["steps"] + 1))
    assert [m.value for m in history] == pytest.approx([r["reward/mean"] for r in rows])
    # fully_async/partial/... keys keep their slashes; a name MLflow refuses (verl's `mean@4`) under mlflow_name's
    assert {mlflow_name(k) for k in rows[-1]} - {"step"} <= set(run.data.metrics)

    # the run's files, and where its sample logs are
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.yaml", "summary.json", "audit.txt"}
    logged = json.loads(open(client.download_artifacts(run_id, "summary.json", str(tmp_path))).read())
    assert logged == summary
    assert run.data.tags["asyncrl.run_dir"] == str(run_dir)
    assert run.data.tags["asyncrl.sample_log"] == str(run_dir / "samples")
