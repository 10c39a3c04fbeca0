"""Checkpoint bookkeeping on disk: commit/latest, the resume rewind, and the data cursor."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import checkpoint
from pipeline.checkpoint import ResumeError
from pipeline.tasks.admission import AdmissionOrder, prompt_id


def _samples(prompts):
    return pa.table({"sample_id": [f"{p}/0" for p in prompts], "prompt_id": prompts})


def test_latest_is_the_last_committed(tmp_path):
    root = str(tmp_path / "ckpt")
    with pytest.raises(ResumeError, match="no checkpoint"):
        checkpoint.latest(root)
    checkpoint.commit(root, 2, 1, [("a", 0, 1.0)], {"outstanding": 3})
    checkpoint.commit(root, 4, 2, [("a", 0, 1.0), ("b", 1, 2.0)], {"outstanding": 1})
    (tmp_path / "ckpt" / "global_step_6").mkdir()  # a checkpoint whose commit never happened
    ckpt = checkpoint.latest(root)
    assert (ckpt.step, ckpt.version) == (4, 2)
    assert ckpt.ledger["prompt_id"].to_pylist() == ["a", "b"]
    state = json.loads((tmp_path / "ckpt" / "global_step_4" / "state.json").read_text())
    assert state["consumed_prompts"] == 2 and state["gate"] == {"outstanding": 1}


def test_rewind_moves_what_came_after_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    (run / "consumed").mkdir(parents=True)
    (run / "samples").mkdir()
    for step in (1, 2, 3):
        pq.write_table(pa.table({"consumed_step": [step]}), run / "consumed" / f"step-{step:07d}.parquet")
    pq.write_table(_samples(["a", "b"]), run / "samples" / "part-1.parquet")  # b was in flight
    pq.write_table(_samples(["c"]), run / "samples" / "part-2.parquet")
    (run / "samples" / "_part-3.parquet.tmp").write_bytes(b"PAR1\x00")  # a shard its stage was killed writing
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    checkpoint.commit(str(run / "checkpoints"), 2, 2, [("a", 0, 0.0)], {})
    moved = checkpoint.rewind(run, checkpoint.latest(str(run / "checkpoints")))
    assert moved == {"consumed_steps": 1, "samples": 2, "metrics_rows": 1}
    assert sorted(p.name for p in (run / "consumed").iterdir()) == ["step-0000001.parquet", "step-0000002.parquet"]
    kept = pa.concat_tables(pq.read_table(p) for p in (run / "samples").iterdir())
    assert kept["prompt_id"].to_pylist() == ["a"]
    gone = pa.concat_tables(pq.read_table(p) for p in (run / "discarded" / "attempt-1" / "samples").iterdir())
    assert sorted(gone["prompt_id"].to_pylist()) == ["b", "c"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert checkpoint.rewind(run, checkpoint.latest(str(run / "checkpoints")))["samples"] == 0
    assert (run / "discarded" / "attempt-2").exists()  # a second resume keeps the first attempt's leftovers


def test_cursor_skips_consumed_prompts_and_keeps_the_order():
    def ids(order: AdmissionOrder) -> list[str]:
        return [prompt_id(epoch, row) for epoch, rows in order.epochs() for row in rows.tolist()]

    full = ids(AdmissionOrder(num_rows=6, total=8, seed=1))
    skip = frozenset(full[:3] + full[5:6])
    rest = ids(AdmissionOrder(num_rows=6, total=8, seed=1, skip=skip))
    assert rest == [p for p in full if p not in skip]


def test_save_freq_must_fall_on_a_sync():
    from pipeline.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="multiple of async_training.trigger_parameter_sync_step"):
        load_config(None, ["trainer.save_freq=3", "async_training.trigger_parameter_sync_step=2"])
    with pytest.raises(ConfigError, match="resume=true needs trainer.run_name"):
        load_config(None, ["resume=true"])
    assert load_config(None, ["trainer.save_freq=4", "async_training.trigger_parameter_sync_step=2"])


def test_a_new_run_refuses_a_directory_that_holds_a_run_and_resume_takes_it(tmp_path):
    from pipeline.config import ConfigError, load_config
    from pipeline.prepare import make_run_dir

    named = [f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    run_dir = make_run_dir(load_config(None, named))
    (run_dir / "model").mkdir()
    assert make_run_dir(load_config(None, named)) == run_dir  # a run that failed its checks: start again there
    (run_dir / "consumed").mkdir()
    with pytest.raises(ConfigError, match=r"trainer.run_name=r: .* already holds a run \(consumed\).*resume=true"):
        make_run_dir(load_config(None, named))
    assert make_run_dir(load_config(None, [*named, "resume=true"])) == run_dir
