"""When `prepare` starts Ray: beside the prompt file's checks, after a missing file is reported, and stopped again
when the checks fail. Ray itself is replaced by a recorder."""

import json

import pytest
import ray

from pipeline import prepare as prepare_module
from pipeline.config import load_config
from pipeline.tasks.source import PromptDataError


@pytest.fixture
def ray_calls(monkeypatch):
    calls: list[str] = []

    def start(cfg, run_dir):
        calls.append("start")
        monkeypatch.setattr(ray, "is_initialized", lambda: True)
        return True

    monkeypatch.setattr(prepare_module, "start_ray", start)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    return calls


def config(tmp_path, data_file):
    overrides = ["model.warm_start_steps=0", "trainer.monitor=jsonl", f"trainer.output_dir={tmp_path}"]
    return load_config(None, [*overrides, f"data.train_files={data_file}"])


def test_a_missing_prompt_file_is_reported_before_ray_starts(tmp_path, ray_calls):
    with pytest.raises(PromptDataError, match="does not exist"):
        prepare_module.prepare(config(tmp_path, tmp_path / "nope.jsonl"))
    assert ray_calls == []


def test_a_bad_row_found_beside_rays_start_stops_ray_again(tmp_path, ray_calls):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_text": None, "ground_truth": "c", "data_source": "reverse"}) + "\n")
    with pytest.raises(PromptDataError, match="row 0"):
        prepare_module.prepare(config(tmp_path, bad))
    assert ray_calls == ["start", "shutdown"]
