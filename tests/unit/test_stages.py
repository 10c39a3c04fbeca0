"""Stages called directly on hand-built batches: no Ray."""

import gc
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import ConfigError, load_config
from schemas import SAMPLE_SCHEMA, MissingColumnsError
from stages import verifiers
from stages.advantage import GRPOAdvantage
from stages.reward import Reward
from stages.sample_log import SampleLog
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def scored(texts: list[str], truth: str = "c b a", source: str = "reverse") -> pa.Table:
    n = len(texts)
    return pa.table(
        {
            "sample_id": [f"p/{i}" for i in range(n)],
            "prompt_id": ["p"] * n,
            "response_text": texts,
            "ground_truth": [truth] * n,
            "data_source": [source] * n,
        }
    )


def test_reward_scores_with_the_verifier():
    out = Reward()(scored(["c b a", "c b", "x"]))
    rewards = out["reward"].to_pylist()
    assert rewards[0] == 1.0 and 0.0 < rewards[1] < 1.0 and rewards[2] == 0.0
    assert out["reward_error"].to_pylist() == [None, None, None]


def test_failing_verifier_marks_the_sample_not_the_run(monkeypatch):
    def broken(response: str, truth: str) -> float:
        if response == "boom":
            raise RuntimeError("parser exploded")
        return 1.0

    def slow(response: str, truth: str) -> float:
        time.sleep(2)
        return 1.0

    monkeypatch.setitem(verifiers.VERIFIERS, "broken", broken)
    monkeypatch.setitem(verifiers.VERIFIERS, "slow", slow)
    monkeypatch.setitem(verifiers.VERIFIERS, "liar", lambda r, t: 7.0)
    batch = pa.concat_tables(
        [
            scored(["boom", "fine"], source="broken"),
            scored(["x"], source="slow"),
            scored(["x"], source="liar"),
            scored(["x"], source="unknown"),
        ]
    )
    out = Reward(timeout_s=0.2)(batch)
    assert out["reward"].to_pylist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    errors = out["reward_error"].to_pylist()
    assert "RuntimeError: parser exploded" in errors[0] and errors[1] is None
    assert "timed out" in errors[2] and "not a float in [0, 1]" in errors[3] and "no verifier" in errors[4]


def test_missing_column_is_named():
    with pytest.raises(MissingColumnsError, match=r"Reward needs column\(s\) \['ground_truth'\]"):
        Reward()(scored(["a"]).drop_columns(["ground_truth"]))


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for a reaper that is not ours counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_block_is_scored_concurrently(monkeypatch):
    # Each score waits until all four samples are being scored at once: a stage that scored them one after another
    # (or two at a time) would time them out, and its scores would be 0.
    import multiprocessing

    everyone = multiprocessing.get_context("fork").Barrier(4)  # the workers are forked: they share it

    def together(response: str, truth: str) -> float:
        everyone.wait(timeout=60)
        return 1.0

    monkeypatch.setitem(verifiers.VERIFIERS, "together", together)
    stage = Reward(num_workers=4, timeout_s=120)
    out = stage(scored(["a", "b", "c", "d"], source="together"))
    stage.close()
    assert out["reward"].to_pylist() == [1.0] * 4, out["reward_error"].to_pylist()


def test_a_hanging_verifier_is_killed_and_the_next_sample_scores(monkeypatch, tmp_path):
    def hang(response: str, truth: str) -> float:
        if response == "hang":
            (tmp_path / "pid").write_text(str(os.getpid()))
            time.sleep(3600)
        return 1.0

    monkeypatch.setitem(verifiers.VERIFIERS, "hang", hang)
    stage = Reward(timeout_s=0.5, num_workers=1)
    out = stage(scored(["hang", "fine"], source="hang"))
    assert out["reward"].to_pylist() == [0.0, 1.0]
    assert "timed out after 0.5s" in out["reward_error"][0].as_py() and out["reward_error"][1].as_py() is None
    hung = int((tmp_path / "pid").read_text())
    assert not alive(hung) and stage.worker_pids() and hung not in stage.worker_pids()
    survivors = stage.worker_pids()
    stage.close()
    assert not any(alive(pid) for pid in survivors + [hung])


def test_math_verify_scores_in_workers_of_a_stage_run_off_the_main_thread():
    # math-verify sets SIGALRM, which only a main thread may: a worker process is its own main thread.
    batch = scored(["The answer is \\boxed{\\sqrt{4}}", "#### 3"], truth="2", source="openai/gsm8k")
    stage, out = Reward(), {}
    thread = threading.Thread(target=lambda: out.update(table=stage(batch)))
    thread.start()
    thread.join()
    stage.close()
    assert out["table"]["reward"].to_pylist() == [1.0, 0.0] and out["table"]["reward_error"].null_count == 2


def test_a_worker_that_dies_marks_its_sample(monkeypatch):
    monkeypatch.setitem(verifiers.VERIFIERS, "exit", lambda r, t: os._exit(3) if r == "die" else 1.0)
    stage = Reward(num_workers=1)
    out = stage(scored(["die", "fine"], source="exit"))
    assert out["reward"].to_pylist() == [0.0, 1.0]
    assert "scoring process died (exit code 3)" in out["reward_error"][0].as_py()
    stage.close()


def test_workers_die_with_their_parent(tmp_path):
    # A parent killed mid-block (SIGKILL: no cleanup of its own) takes its workers along, the hung one included.
    entered = tmp_path / "entered"  # the hanging verifier's mark: a worker is in it
    script = (
        "import time\n"
        "from stages import verifiers\n"
        "from stages.reward import Reward\n"
        "from tests.unit.test_stages import scored\n"
        f"verifiers.VERIFIERS['hang'] = lambda r, t: open({str(entered)!r}, 'w').close() or time.sleep(3600)\n"
        "stage = Reward(timeout_s=600)\n"
        "stage(scored(['c b a']))\n"
        "print(*stage.worker_pids(), flush=True)\n"
        "stage(scored(['x'], source='hang'))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    wait_until(entered.exists, 60, "a worker entering the hanging verifier")  # the other waits for work
    parent.kill()
    parent.wait()
    wait_until(lambda: not any(alive(p) for p in pids), 10, "the workers ending with their parent", poll_s=0.05)


def test_the_stage_pickles_without_its_workers():
    stage = Reward()
    stage(scored(["c b a"]))
    copy = pickle.loads(pickle.dumps(stage))  # as Ray Data ships it to a task
    assert copy.worker_pids() == [] and copy(scored(["c b a"]))["reward"].to_pylist() == [1.0]
    assert set(copy.worker_pids()).isdisjoint(stage.worker_pids())
    pids = stage.worker_pids() + copy.worker_pids()
    del stage, copy
    gc.collect()
    assert not any(alive(p) for p in pids)  # collected stages end their workers


CUSTOM = """
import math


def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if solution_str == "boom":
        raise ValueError("no answer")
    special = {"nan": math.nan, "inf": math.inf, "text": "1", "no score": {"acc": 1.0}, "true": True}
    if solution_str in special:
        return special[solution_str]
    right = solution_str == ground_truth
    return {"score": float(right) + bonus, "acc": right, "source": data_source, "turns": extra_info["num_turns"]}
"""


def test_a_custom_function_scores_every_sample(tmp_path):
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    stage = Reward(custom_path=str(tmp_path / "my_reward.py"), reward_kwargs={"bonus": 0.5})
    # verl semantics: the custom function replaces the routing by data_source (no verifier is named "mine")
    out = stage(scored(["c b a", "x", "true"], source="mine"))
    stage.close()
    assert out["reward"].to_pylist() == [1.5, 0.5, 1.0]  # no [0, 1] range for custom functions, as in verl
    assert out["reward_error"].null_count == 3
    extras = out["reward_extra_info"].to_pylist()
    assert json.loads(extras[0]) == {"acc": True, "source": "mine", "turns": 2}  # 2 turns: prompt and response
    assert json.loads(extras[1])["acc"] is False
    assert json.loads(extras[2]) == {"acc": 1.0}  # a number, not a dict: verl's naive manager records it as acc


def test_a_custom_function_failing_marks_only_its_sample(tmp_path):
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    stage = Reward(custom_path=f"file://{tmp_path}/my_reward.py")
    out = stage(scored(["boom", "nan", "inf", "text", "no score", "c b a"]))
    stage.close()
    assert out["reward"].to_pylist() == [0.0] * 5 + [1.0]
    errors = out["reward_error"].to_pylist()
    assert "compute_score raised ValueError: no answer" in errors[0]
    assert all("not a finite number" in e for e in errors[1:4])
    assert "without a 'score' key" in errors[4] and errors[5] is None


def test_an_unloadable_custom_function_marks_every_sample(tmp_path):
    out = Reward(custom_path=str(tmp_path / "missing.py"))(scored(["c b a", "x"]))
    assert out["reward"].to_pylist() == [0.0, 0.0]
    assert all("no such file" in e for e in out["reward_error"].to_pylist())


@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        ("def compute_score(solution_str, ground_truth):\n    return 1.0\n", [], "cannot be called as"),
        (
            "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n",
            ["reward.custom_reward_function.reward_kwargs.scale=2"],
            "reward_kwargs ['scale']",
        ),
        ("def score(**kwargs):\n    return 1.0\n", [], "defines no function 'compute_score'"),
        ("import no_such_module\n", [], "fails to import: ModuleNotFoundError"),
        (
            "def compute_score(**kwargs):\n    return 1.0\n",
            ["reward.custom_reward_function.name=other"],
            "no function 'other'",
        ),
    ],
)
def test_load_config_refuses_a_bad_custom_function(tmp_path, source, overrides, message):
    (tmp_path / "my_reward.py").write_text(source)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, [f"custom_reward_function.path={tmp_path}/my_reward.py", *overrides])


def test_load_config_takes_a_good_custom_function(tmp_path):
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    cfg = load_config(
        None, [f"custom_reward_function.path={tmp_path}/my_reward.py", "custom_reward_function.reward_kwargs.bonus=1"]
    )
    assert (
        cfg.reward.custom_reward_function.name == "compute_score"
        and cfg.reward.custom_reward_function.reward_kwargs == {"bonus": 1}
    )


def test_grpo_advantage_by_hand():
    rewards = pa.array([1.0, 0.0, 0.5, 1.0, 1.0, 1.0], pa.float32())
    masks = [[1, 1], [1, 0], [1], [1], [1], [0, 1]]
    batch = pa.table({"prompt_id": ["a", "a", "a", "b", "b", "b"], "reward": rewards, "response_mask": masks})
    out = GRPOAdvantage(group_size=3)(batch)
    adv = out["advantage"].to_numpy()
    r = np.array([1.0, 0.0, 0.5])
    expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    assert np.allclose(adv[:3], expected, atol=1e-6)
    assert np.allclose(adv[3:], 0.0)  # all equal: no signal, no NaN
    per_token = out["token_advantages"].to_pylist()
    assert np.allclose(per_token[1], [adv[1], 0.0]) and np.allclose(per_token[0], [adv[0]] * 2)


def test_grpo_advantage_refuses_a_split_group():
    batch = pa.table(
        {"prompt_id": ["a", "a"], "reward": pa.array([1.0, 0.0], pa.float32()), "response_mask": [[1], [1]]}
    )
    with pytest.raises(ValueError, match="group a has 2 of its 3 responses"):
        GRPOAdvantage(group_size=3)(batch)


def test_sample_log_writes_every_column(tmp_path):
    row = {name: None for name in SAMPLE_SCHEMA.names}
    batch = pa.Table.from_pylist([{**row, "sample_id": "p/0", "token_param_version": [0, 1]}], schema=SAMPLE_SCHEMA)
    assert SampleLog(str(tmp_path / "samples"))(batch) is batch
    shards = list((tmp_path / "samples").iterdir())
    assert len(shards) == 1
    written = pq.read_table(shards[0])
    assert written.schema == SAMPLE_SCHEMA and written["token_param_version"].to_pylist() == [[0, 1]]


def test_a_block_logged_again_replaces_its_shard(tmp_path):
    """A replica that dies after logging a block runs it again on restart: its samples are logged once."""
    row = {name: None for name in SAMPLE_SCHEMA.names}
    block = pa.Table.from_pylist([{**row, "sample_id": f"p/{i}"} for i in range(2)], schema=SAMPLE_SCHEMA)
    log = SampleLog(str(tmp_path / "samples"))
    log(block)
    log(block.take([1, 0]))  # the retry, in any order
    log(block.slice(0, 1))  # another block
    shards = sorted((tmp_path / "samples").iterdir())
    assert len(shards) == 2 and sorted(pq.read_table(shard).num_rows for shard in shards) == [1, 2]


def test_a_shard_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    import pyarrow.dataset as pds

    from stages import sample_log

    good = pa.table({"sample_id": ["p/0"]})
    sample_log.write_shard(good, f"{tmp_path}/samples/part-1.parquet")
    real = pq.write_table

    def killed_midway(table, where, **kwargs):  # the bytes of a writer killed before the footer
        where.write(b"PAR1" + b"\x00" * 64)
        raise KeyboardInterrupt

    monkeypatch.setattr(sample_log.pq, "write_table", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        sample_log.write_shard(good, f"{tmp_path}/samples/part-2.parquet")
    monkeypatch.setattr(sample_log.pq, "write_table", real)
    assert sorted(p.name for p in (tmp_path / "samples").glob("*.parquet")) == ["part-1.parquet"]
    assert pds.dataset(str(tmp_path / "samples")).to_table()["sample_id"].to_pylist() == ["p/0"]  # skips "_..."
