"""Validation metrics by hand, and the driver's refusal of a pass with mixed weight versions."""

from pathlib import Path

import pytest

from pipeline.config import RolloutConfig, RunConfig
from pipeline.validate import Validator, pass_at_k, val_metrics


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2) / C(4,2)


def test_metrics_per_data_source():
    rows = [
        *({"data_source": "a", "prompt_id": "p1", "reward": r} for r in (1.0, 0.0, 0.0, 0.0)),
        *({"data_source": "a", "prompt_id": "p2", "reward": r} for r in (1.0, 1.0, 0.0, 1.0)),
        *({"data_source": "b", "prompt_id": "p3", "reward": r} for r in (0.5, 0.25, 0.0, 0.0)),
    ]
    m = val_metrics(rows, 4)
    assert m["val/a/reward/mean@4"] == pytest.approx(4 / 8)
    assert m["val/a/reward/best@4"] == 1.0
    assert m["val/a/reward/pass@1"] == pytest.approx((0.25 + 0.75) / 2)
    assert m["val/a/reward/pass@4"] == 1.0
    assert m["val/b/reward/mean@4"] == pytest.approx(0.75 / 4)
    assert m["val/b/reward/best@4"] == 0.5
    assert "val/b/reward/pass@1" not in m  # partial credit: no right/wrong verdict


def test_a_pass_with_mixed_versions_is_refused(tmp_path):
    validator = Validator(None, None, RunConfig(rollout=RolloutConfig(test_freq=1)), tmp_path)
    sample = {"sample_id": "val-3/x/0", "prompt_id": "x", "data_source": "reverse", "ground_truth": "a"}
    sample |= {"response_text": "a", "num_tokens": 2, "finish_reason": "stop"}
    assert validator._finish(3, [{**sample, "token_param_version": [3, 3]}])["val/reverse/reward/mean@1"] == 1.0
    with pytest.raises(RuntimeError, match="posted at version 3 has tokens of versions \\[3, 4\\]"):
        validator._finish(3, [{**sample, "token_param_version": [3, 4]}])
    with pytest.raises(RuntimeError, match="versions \\[3, 4\\]"):  # each sample whole, but the pass mixed
        validator._finish(3, [{**sample, "token_param_version": [3]}, {**sample, "token_param_version": [4]}])


def test_close_removes_the_dedicated_engines_files_and_the_default_store(tmp_path):
    run_dir = tmp_path / "closing"
    validator = Validator(None, None, RunConfig(), run_dir, engine=object())
    store = Path(validator.store)
    assert str(store).startswith("/dev/shm/asyncrl-closing-") and store.name == "validation"
    store.mkdir(parents=True)
    (store / "version-000004.safetensors").write_bytes(b"x")
    validator.close()
    assert not store.parent.exists()  # nothing of the run is left in shared memory (push mode: no pull store)
