"""GRPOAdvantage: group-normalised rewards, one advantage per trajectory.

Input columns:  prompt_id, reward, response_mask
Output columns: input columns + advantage (float32), token_advantages (list<float32>: advantage on every trained
                token, 0 on masked ones)

advantage = (reward - mean of its group) / (std of its group + epsilon), the group being the `rollout.n`
responses to one prompt; std is the unbiased one, as verl's GRPO computes it, and a group of one gets 0. A group
split across blocks would silently get the wrong mean, so an incomplete group is an error, not a guess.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns


class GRPOAdvantage:
    def __init__(self, group_size: int, epsilon: float = 1e-6, norm_by_std: bool = True) -> None:
        self.group_size = group_size
        self.epsilon = epsilon
        self.norm_by_std = norm_by_std

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, ["prompt_id", "reward", "response_mask"], "GRPOAdvantage")
        rewards = batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
        groups: dict[str, list[int]] = defaultdict(list)
        for i, pid in enumerate(batch.column("prompt_id").to_pylist()):
            groups[pid].append(i)
        advantage = np.zeros(len(rewards), dtype=np.float64)
        for pid, rows in groups.items():
            if len(rows) != self.group_size:
                raise ValueError(f"group {pid} has {len(rows)} of its {self.group_size} responses in this block")
            r = rewards[rows]
            centred = r - r.mean()
            if self.norm_by_std and len(rows) > 1:
                centred = centred / (r.std(ddof=1) + self.epsilon)
            advantage[rows] = centred if len(rows) > 1 else 0.0
        masks = batch.column("response_mask").to_pylist()
        per_token = [(a * np.asarray(m, np.float32)).tolist() for a, m in zip(advantage, masks, strict=True)]
        batch = batch.append_column(SAMPLE_SCHEMA.field("advantage"), pa.array(advantage, pa.float32()))
        return batch.append_column(SAMPLE_SCHEMA.field("token_advantages"), pa.array(per_token, pa.list_(pa.float32())))
