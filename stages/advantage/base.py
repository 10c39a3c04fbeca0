"""What every advantage estimator shares: the block's token-level rewards as verl's trainer builds them, the
complete groups, and the output columns. An estimator subclasses AdvantageStage and writes `estimate`.

Input columns:  prompt_id, reward, response_mask; with the KL in the reward also response_logprobs, ref_logprobs
Output columns: input columns + advantage (float32), token_advantages (list<float32>, 0 where the mask is 0);
                with the KL in the reward also reward_kl (float32)

Token-level rewards (verl's `token_level_rewards`): the verifier score sits on the last response token (the last
of the response, whatever its mask). With `kl_in_reward`, every token also pays beta * kl(old, ref), the KL
masked by response_mask, where old is the behaviour logprob the engine reported (`response_logprobs`) and ref the
frozen initial policy's (`ref_logprobs`, from stages.ref_logprob). Outcome estimators take the row sum of the
token-level rewards as the sample's score (score - beta * sum of its masked KL); per-token estimators take the
rewards themselves. `reward_kl` is the sample's masked mean token KL, what verl's `actor/reward_kl_penalty`
averages; only a fixed coefficient is supported (verl's FixedKLController).

Samples the reward step left out (`reward_status` 'masked' or 'dropped', stages/reward_sources.py) leave the loss and
their group's statistics: their response_mask (in the output too, which is what the trainer reads) and advantages are
0, and their group's baseline is computed over the members that count. A group left with one member that counts
(out of a group_size above 1) gives it advantage 0: it has no peer to be compared with.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pyarrow as pa

from schemas import SAMPLE_SCHEMA, require_columns
from stages.reward_sources import LEFT_OUT

MASK_EPS = 1e-8  # verl's masked mean: sum / (count + 1e-8), so an empty row gives 0, not NaN


@dataclass
class TokenRewards:
    """One block's rewards, rows right-padded with zeros to its longest response."""

    mask: np.ndarray  # (B, L) response_mask as float64
    lengths: np.ndarray  # (B,) response lengths
    token_rewards: np.ndarray  # (B, L) score on the last token, minus beta * masked KL on every token
    score: np.ndarray  # (B,) row sums of token_rewards: the outcome estimators' score
    reward_kl: np.ndarray | None  # (B,) masked mean token KL; None without the KL in the reward
    counts: np.ndarray | None = None  # (B,) bool: the sample is in the loss; None: every sample is


def pad_rows(rows: list, width: int) -> np.ndarray:
    """Ragged rows as a (len(rows), width) float64 array, zero-padded on the right."""
    out = np.zeros((len(rows), width), np.float64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def first_trained(token_adv: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Each row's advantage on its first trained token (0 for a row with none): the `advantage` column of a
    per-token estimator."""
    first = np.argmax(mask > 0, axis=1)
    return np.where(mask.any(axis=1), token_adv[np.arange(len(mask)), first], 0.0)


class AdvantageStage:
    """Base of the estimators; `whiten_over_step` tells the wiring that the sink must whiten the step's
    token_advantages (stages.advantage.whiten.whiten_step) before it splits the step into mini-batches."""

    whiten_over_step: ClassVar[bool] = False

    def __init__(
        self, group_size: int, kl_in_reward: bool = False, kl_coef: float = 0.001, kl_penalty: str = "kl"
    ) -> None:
        self.group_size = group_size
        self.kl_in_reward = kl_in_reward
        self.kl_coef = kl_coef
        self.kl_penalty = kl_penalty

    def estimate(self, batch: pa.Table, rewards: TokenRewards) -> tuple[np.ndarray, np.ndarray]:
        """(B, L) token advantages (0 where the mask is 0) and (B,) the `advantage` column."""
        raise NotImplementedError

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, ["prompt_id", "reward", "response_mask"], type(self).__name__)
        rewards = self.token_rewards(batch)
        token_adv, seq_adv = self.estimate(batch, rewards)
        per_token = [token_adv[i, :n].astype(np.float32) for i, n in enumerate(rewards.lengths)]
        if rewards.counts is not None:  # the trainer reads this mask: the samples left out leave the loss
            masks = [rewards.mask[i, :n].astype(np.int8) for i, n in enumerate(rewards.lengths)]
            field = SAMPLE_SCHEMA.field("response_mask")
            batch = batch.set_column(batch.schema.get_field_index("response_mask"), field, pa.array(masks, field.type))
        batch = batch.append_column(SAMPLE_SCHEMA.field("advantage"), pa.array(seq_adv, pa.float32()))
        batch = batch.append_column(
            SAMPLE_SCHEMA.field("token_advantages"), pa.array(per_token, SAMPLE_SCHEMA.field("token_advantages").type)
        )
        if rewards.reward_kl is not None:
            batch = batch.append_column(SAMPLE_SCHEMA.field("reward_kl"), pa.array(rewards.reward_kl, pa.float32()))
        return batch

    def token_rewards(self, batch: pa.Table) -> TokenRewards:
        masks = batch.column("response_mask").to_pylist()
        lengths = np.array([len(m) for m in masks], np.int64)
        width = int(lengths.max(initial=0))
        mask = pad_rows(masks, width)
        counts = _counted(batch)
        if counts is not None:
            mask[~counts] = 0.0
        score = batch.column("reward").to_numpy(zero_copy_only=False).astype(np.float64)
        token_rewards = np.zeros_like(mask)
        rows = np.flatnonzero(lengths > 0)
        token_rewards[rows, lengths[rows] - 1] = score[rows]
        if not self.kl_in_reward:
            return TokenRewards(mask, lengths, token_rewards, score, None, counts)
        kld = self._token_kl(batch, mask, width)
        token_rewards -= self.kl_coef * kld
        reward_kl = kld.sum(axis=1) / (mask.sum(axis=1) + MASK_EPS)
        return TokenRewards(mask, lengths, token_rewards, score - self.kl_coef * kld.sum(axis=1), reward_kl, counts)

    def _token_kl(self, batch: pa.Table, mask: np.ndarray, width: int) -> np.ndarray:
        """kl(behaviour, reference) per token, masked (verl: kl_penalty(old_log_prob, ref_log_prob) * mask)."""
        import torch  # only with the KL in the reward

        from stages.trainer.kl import kl_penalty

        where = f"{type(self).__name__} with algorithm.use_kl_in_reward"
        require_columns(batch, ["response_logprobs", "ref_logprobs"], where)
        ref_rows = batch.column("ref_logprobs").to_pylist()
        if any(r is None for r in ref_rows):
            raise ValueError(f"{where}: some rows have no ref_logprobs; the RefLogprob stage must score every sample")
        old, ref = pad_rows(batch.column("response_logprobs").to_pylist(), width), pad_rows(ref_rows, width)
        return kl_penalty(torch.from_numpy(old), torch.from_numpy(ref), self.kl_penalty).numpy() * mask

    def groups(self, batch: pa.Table) -> list[np.ndarray]:
        """Row indices of each prompt's group. A group split across blocks would silently get the wrong
        statistics, so an incomplete one is an error, not a guess."""
        rows: dict[str, list[int]] = defaultdict(list)
        for i, pid in enumerate(batch.column("prompt_id").to_pylist()):
            rows[pid].append(i)
        for pid, idx in rows.items():
            if len(idx) != self.group_size:
                raise ValueError(f"group {pid} has {len(idx)} of its {self.group_size} responses in this block")
        return [np.asarray(idx) for idx in rows.values()]


class OutcomeAdvantage(AdvantageStage):
    """An estimator of one advantage per sample from its group's scores, broadcast over its trained tokens."""

    def group_advantage(self, scores: np.ndarray) -> np.ndarray:
        """The advantages of one group's scores."""
        raise NotImplementedError

    def estimate(self, batch: pa.Table, rewards: TokenRewards) -> tuple[np.ndarray, np.ndarray]:
        seq_adv = self.per_group(batch, rewards, rewards.score)
        return seq_adv[:, None] * rewards.mask, seq_adv

    def per_group(self, batch: pa.Table, rewards: TokenRewards, scores: np.ndarray) -> np.ndarray:
        """(B,) group_advantage of `scores` within each group, over the samples in the loss (others stay 0)."""
        seq_adv = np.zeros(len(scores), np.float64)
        for rows in self.groups(batch):
            if rewards.counts is not None:
                rows = rows[rewards.counts[rows]]
                if len(rows) == 1 and self.group_size > 1:  # no peer left to be compared with
                    continue
            if len(rows):
                seq_adv[rows] = self.group_advantage(scores[rows])
        return seq_adv


def _counted(batch: pa.Table) -> np.ndarray | None:
    """(B,) bool: the samples the reward step left in the loss; None when it left none out (or did not run)."""
    if "reward_status" not in batch.column_names:
        return None
    counts = np.array([s not in LEFT_OUT for s in batch.column("reward_status").to_pylist()], bool)
    return None if counts.all() else counts
