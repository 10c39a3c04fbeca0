"""Reward: score each response with the verifier of its data source.

Input columns:  sample_id, response_text, ground_truth, data_source
Output columns: input columns + reward (float32), reward_error (string, null when the verifier succeeded),
                reward_extra_info (string, null)

A verifier that raises, returns something outside [0, 1] or runs past `timeout_s` marks that sample (reward 0 and
the reason in reward_error); it never fails the run. Runs as a Ray Data task stage: it holds no state worth an
actor, and tasks keep scoring off the trainer's critical path.
"""

from __future__ import annotations

import concurrent.futures as cf
import math

import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns
from stages.verifiers import VERIFIERS

_NEEDS = ["sample_id", "response_text", "ground_truth", "data_source"]


class Reward:
    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, _NEEDS, "Reward")
        rewards, errors = [], []
        pool = cf.ThreadPoolExecutor(max_workers=1)
        for row in batch.select(_NEEDS).to_pylist():
            reward, error = self._score(pool, row)
            if error is not None and "timed out" in error:
                # The stuck thread cannot be killed: abandon it, so it does not delay the next sample.
                pool.shutdown(wait=False, cancel_futures=True)
                pool = cf.ThreadPoolExecutor(max_workers=1)
            rewards.append(reward)
            errors.append(error)
        pool.shutdown(wait=False, cancel_futures=True)
        batch = batch.append_column(SAMPLE_SCHEMA.field("reward"), pa.array(rewards, pa.float32()))
        batch = batch.append_column(SAMPLE_SCHEMA.field("reward_error"), pa.array(errors, pa.string()))
        return batch.append_column(SAMPLE_SCHEMA.field("reward_extra_info"), pa.nulls(batch.num_rows, pa.string()))

    def _score(self, pool: cf.ThreadPoolExecutor, row: dict) -> tuple[float, str | None]:
        verifier = VERIFIERS.get(row["data_source"])
        if verifier is None:
            return 0.0, f"no verifier for data_source {row['data_source']!r}; known: {sorted(VERIFIERS)}"
        try:
            value = pool.submit(verifier, row["response_text"], row["ground_truth"]).result(self.timeout_s)
        except cf.TimeoutError:
            return 0.0, f"verifier {row['data_source']!r} timed out after {self.timeout_s}s"
        except Exception as err:  # noqa: BLE001 - any verifier failure marks the sample, never the run
            return 0.0, f"verifier {row['data_source']!r} raised {type(err).__name__}: {err}"
        if not isinstance(value, int | float) or math.isnan(value) or not 0.0 <= value <= 1.0:
            return 0.0, f"verifier {row['data_source']!r} returned {value!r}, not a float in [0, 1]"
        return float(value), None
