"""Bad input gets one clear error naming the problem and the fix, through the real `asyncrl` command."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]


def asyncrl(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args, f"trainer.output_dir={tmp_path}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("asyncrl:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return errors[0]


def test_help_is_instant():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "asyncrl run" in out.stdout
    assert time.monotonic() - start < 5  # nothing heavy is imported before a command runs
    assert "torch" not in out.stderr


def test_config_typo_names_the_nearest_key(tmp_path):
    msg = one_error(asyncrl("run", "async_training.staleness_treshold=0.5", tmp_path=tmp_path))
    assert "staleness_treshold" in msg and "Did you mean 'staleness_threshold'" in msg


def test_missing_data_file(tmp_path):
    # With the embedded model's default warm start: the file is checked before that is spent, and before Ray.
    result = asyncrl("run", f"data.train_files={tmp_path}/nope.parquet", tmp_path=tmp_path)
    msg = one_error(result)
    assert "nope.parquet does not exist" in msg and "data.train_files" in msg
    assert "warm start" not in result.stdout and "Started a local Ray" not in result.stderr


def test_missing_column_names_column_and_file(tmp_path):
    bad = tmp_path / "no_truth.parquet"
    pq.write_table(pa.table({"prompt_text": ["reverse: a b ="], "data_source": ["reverse"]}), bad)
    msg = one_error(asyncrl("run", f"data.train_files={bad}", "model.warm_start_steps=0", tmp_path=tmp_path))
    assert "['ground_truth']" in msg and str(bad) in msg


def test_malformed_row_names_the_row(tmp_path):
    bad = tmp_path / "bad_row.jsonl"
    rows = [
        {"prompt_text": "reverse: a b =", "ground_truth": "b a", "data_source": "reverse"},
        {"prompt_text": None, "ground_truth": "c", "data_source": "reverse"},
    ]
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    msg = one_error(asyncrl("run", f"data.train_files={bad}", "model.warm_start_steps=0", tmp_path=tmp_path))
    assert "row 1" in msg and "'prompt_text'" in msg and str(bad) in msg


def test_verl_format_bad_row_names_row_and_column(tmp_path):
    bad = tmp_path / "verl.parquet"
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "1 + 1?"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
        },
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": "2 + 2?"}],
            "reward_model": {"style": "rule", "ground_truth": None},
        },
    ]
    pq.write_table(pa.Table.from_pylist(rows), bad)
    msg = one_error(asyncrl("run", f"data.train_files={bad}", "model.warm_start_steps=0", tmp_path=tmp_path))
    assert "row 1" in msg and "'reward_model'" in msg and "ground_truth" in msg and str(bad) in msg


def test_lengths_beyond_the_model_context(tmp_path):
    msg = one_error(asyncrl("run", "data.max_prompt_length=240", "model.warm_start_steps=0", tmp_path=tmp_path))
    assert "config error" in msg and "256 positions" in msg and "data.max_prompt_length (240)" in msg


def test_unreachable_tracking_server_fails_at_start(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on: held, never listened on, until the run is done
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        start = time.monotonic()
        msg = one_error(asyncrl("run", f"trainer.mlflow_tracking_uri=http://127.0.0.1:{port}", tmp_path=tmp_path))
    assert "trainer.mlflow_tracking_uri" in msg and f"127.0.0.1:{port}" in msg
    assert time.monotonic() - start < 60  # before the warm start and Ray, without minutes of retries


def test_a_reward_function_verl_cannot_call_fails_at_start(tmp_path):
    user_file = tmp_path / "my_reward.py"
    user_file.write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    start = time.monotonic()
    msg = one_error(asyncrl("run", f"custom_reward_function.path={user_file}", tmp_path=tmp_path))
    assert "config error" in msg and "compute_score(solution_str, ground_truth)" in msg and str(user_file) in msg
    assert "cannot be called as compute_score(data_source=" in msg and "extra_info=None, **kwargs" in msg
    assert time.monotonic() - start < 30  # from the config check: before the warm start and Ray


def test_an_unreachable_reward_service_fails_at_start(tmp_path):
    with socket.socket() as s:  # a loopback port nothing listens on: held, never listened on, until the run is done
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        result = asyncrl("run", f"reward.remote.url=http://127.0.0.1:{port}/score", tmp_path=tmp_path)
    msg = one_error(result)
    assert f"reward.remote.url http://127.0.0.1:{port}/score cannot be reached" in msg
    assert "Start the service, or fix the URL" in msg
    assert "warm start" not in result.stdout  # found before the warm start and Ray


def test_a_missing_reward_model_directory_fails_at_start(tmp_path):
    args = ["reward.reward_model.enable=true", f"reward.reward_model.model_path={tmp_path}/no_rm"]
    result = asyncrl("run", *args, tmp_path=tmp_path)
    msg = one_error(result)
    assert f"reward.reward_model.model_path '{tmp_path}/no_rm' has no config.json" in msg
    assert "warm start" not in result.stdout


def test_a_layout_the_cluster_cannot_place_fails_at_start(tmp_path):
    # A local Ray of 2 logical CPUs cannot hold the trainer and two engines (a CPU each) and the gate (0.1): without
    # the check one engine would wait for a CPU for ever and the run would hang.
    start = time.monotonic()
    args = ["ray.num_cpus=2", "rollout.num_replicas=2", "model.warm_start_steps=0", "trainer.monitor=jsonl"]
    msg = one_error(asyncrl("run", *args, tmp_path=tmp_path))
    assert "the Ray cluster cannot place this layout" in msg
    assert "ask for 3.1 CPU on the cluster, which has 2 CPU. Nodes: head: 2 CPU" in msg
    assert "rollout.num_replicas" in msg and "ray.num_cpus" in msg
    assert time.monotonic() - start < 120  # Ray's start, then the check: before any actor


def test_a_run_name_that_holds_a_run_needs_resume_or_another_name(tmp_path):
    (tmp_path / "exp1" / "samples").mkdir(parents=True)  # what an earlier run with that name left
    result = asyncrl("run", "trainer.run_name=exp1", tmp_path=tmp_path)
    msg = one_error(result)
    assert "already holds a run (samples)" in msg and "resume=true" in msg and "another trainer.run_name" in msg
    assert "warm start" not in result.stdout and "Started a local Ray" not in result.stderr


def test_audit_of_a_missing_or_unfinished_run_dir_says_what_is_missing(tmp_path):
    def audit(run_dir: Path) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "audit", str(run_dir)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return one_error(result)

    assert (
        audit(tmp_path / "nope") == f"asyncrl: cannot audit: {tmp_path / 'nope'} is not a directory: give the run "
        "directory (<trainer.output_dir>/<run_name>)"
    )
    run_dir = tmp_path / "killed"
    (run_dir / "samples").mkdir(parents=True)  # what a run killed before its end leaves: no ledger
    assert "has no config.yaml (the run's resolved config" in audit(run_dir)
    (run_dir / "config.yaml").write_text("rollout:\n  n: 4\n")
    msg = audit(run_dir)
    assert f"{run_dir} has no admitted.parquet (the gate's ledger, written when the run finishes" in msg
    assert "resume=true" in msg
