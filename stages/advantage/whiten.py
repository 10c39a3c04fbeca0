"""whiten_step: verl's batch-wide masked whitening of the token advantages, applied by the training sink to a whole
step's table (the estimators whose class sets `whiten_over_step`).

Over every trained token of the step (response_mask 1): mean = sum / (count + 1e-8), variance the unbiased one
(the masked mean of squared deviations times count / (count - 1)), and
token_advantages = (x - mean) / sqrt(variance + 1e-8) on trained tokens, 0 on masked ones. `advantage` becomes
each row's first trained token's value, so the two columns stay consistent.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stages.advantage.base import MASK_EPS, first_trained, pad_rows

WHITEN_EPS = 1e-8  # inside the square root, as verl's masked_whiten


def whiten_step(table: pa.Table) -> pa.Table:
    """The table with its token_advantages whitened over all its trained tokens, and advantage to match."""
    masks = table.column("response_mask").to_pylist()
    lengths = [len(m) for m in masks]
    width = max(lengths, default=0)
    mask = pad_rows(masks, width)
    values = pad_rows(table.column("token_advantages").to_pylist(), width)
    count = mask.sum()
    if count < 2:
        raise ValueError(
            f"whitening the step's advantages needs at least 2 trained tokens, the step has {int(count)}: "
            "responses are empty or fully masked; use an estimator without whitening (algorithm.adv_estimator=grpo)"
        )
    mean = (values * mask).sum() / (count + MASK_EPS)
    variance = ((values - mean) ** 2 * mask).sum() / (count + MASK_EPS) * count / (count - 1)
    whitened = (values - mean) / np.sqrt(variance + WHITEN_EPS) * mask
    per_token = [whitened[i, :n].astype(np.float32) for i, n in enumerate(lengths)]
    out = table.set_column(
        table.schema.get_field_index("token_advantages"),
        table.schema.field("token_advantages"),
        pa.array(per_token, table.schema.field("token_advantages").type),
    )
    return out.set_column(
        out.schema.get_field_index("advantage"),
        out.schema.field("advantage"),
        pa.array(first_trained(whitened, mask), out.schema.field("advantage").type),
    )
