"""GPGAdvantage (`algorithm.adv_estimator=gpg`): the group-centred score, scaled by how few scores are nonzero.

Input/output columns: as GRPOAdvantage.

verl's compute_gpg_outcome_advantage: alpha * (s - mean of the group) / f_norm, f_norm 1, a group of one centred on
0, and alpha = B / (nonzero scores, at least 1) over the whole training batch, so a batch where few responses score
carries a larger gradient. The stage centres each group; the scale needs the whole step, so the training sink applies
it to the step's table (`over_step`) before splitting it into mini-batches. The nonzero count reads the verifier's
`reward` (verl counts the score after any KL in the reward, which is rarely exactly 0).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from stages.advantage.base import OutcomeAdvantage


class GPGAdvantage(OutcomeAdvantage):
    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        return scores - (scores.mean() if len(scores) > 1 else 0.0)

    @staticmethod
    def over_step(table: pa.Table) -> pa.Table:
        """The step's advantages times alpha = rows / nonzero rewards."""
        rewards = np.asarray(table.column("reward").to_pylist(), np.float64)
        alpha = len(rewards) / max(int(np.count_nonzero(rewards)), 1)
        token_type, seq_type = table.schema.field("token_advantages").type, table.schema.field("advantage").type
        tokens = [(np.asarray(v, np.float64) * alpha).astype(np.float32) for v in table["token_advantages"].to_pylist()]
        seq = (np.asarray(table["advantage"].to_pylist(), np.float64) * alpha).astype(np.float32)
        table = table.set_column(
            table.schema.get_field_index("token_advantages"), "token_advantages", pa.array(tokens, token_type)
        )
        return table.set_column(table.schema.get_field_index("advantage"), "advantage", pa.array(seq, seq_type))
