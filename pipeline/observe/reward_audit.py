"""The audit's account of reward failures, from the sample log alone (pipeline/observe/audit.py runs it).

Every sample whose reward failed must say so and be handled as its status says (stages/reward_sources.py): an error in
reward_error with reward 0; status 'zero', 'masked' or 'dropped', never 'ok'; a masked or dropped sample out of the
loss (response_mask and token_advantages all 0); a dropped group dropped whole; every source record of a failure
with its error. The detail line counts them by status and the retries by source, so a run's failures are on the
record whatever its policy.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import pyarrow as pa

LEFT_OUT = ("masked", "dropped")


def left_out(samples: pa.Table) -> list[bool]:
    """Per sample: the reward step left it out of the loss (its tokens are masked on purpose)."""
    if "reward_status" not in samples.column_names:
        return [False] * samples.num_rows
    return [s in LEFT_OUT for s in samples["reward_status"].to_pylist()]


def reward_failures(samples: pa.Table) -> tuple[bool, str] | None:
    """(holds, detail) of the check, or None when the run's samples carry no reward_status."""
    if "reward_status" not in samples.column_names or samples["reward_status"].null_count == samples.num_rows:
        return None
    columns = ["prompt_id", "reward", "reward_error", "reward_status", "response_mask", "token_advantages"]
    rows = samples.select(columns + ["reward_sources"]).to_pylist()
    bad: list[str] = []
    status, retries = Counter(), Counter()
    group_status: dict[str, set] = defaultdict(set)
    for row in rows:
        status[row["reward_status"]] += 1
        group_status[row["prompt_id"]].add(row["reward_status"])
        records = dict(row["reward_sources"] or [])
        for name, rec in records.items():
            retries[name] += rec["attempts"] - 1
        failed = row["reward_error"] is not None
        if failed and (row["reward_status"] == "ok" or row["reward"] != 0.0):
            bad.append(f"{row['prompt_id']}: an error but status {row['reward_status']}, reward {row['reward']}")
        if not failed and row["reward_status"] in ("zero", "masked"):
            bad.append(f"{row['prompt_id']}: status {row['reward_status']} without an error")
        if failed and not any(r["error"] for r in records.values()):
            bad.append(f"{row['prompt_id']}: an error no source record holds")
        if row["reward_status"] in LEFT_OUT and (any(row["response_mask"]) or any(row["token_advantages"])):
            bad.append(f"{row['prompt_id']}: {row['reward_status']} but still in the loss")
    bad += [f"{pid}: dropped in part" for pid, s in group_status.items() if "dropped" in s and len(s) > 1]
    failed = sum(1 for r in rows if r["reward_error"] is not None)
    counts = ", ".join(f"{n} {s}" for s, n in sorted(status.items()))
    tried = ", ".join(f"{n} {s}" for s, n in sorted(retries.items()) if n) or "none"
    detail = f"{failed} of {len(rows)} samples failed to score ({counts}); retries: {tried}"
    return not bad, detail + (f"; e.g. {bad[0]}" if bad else "")
