"""How a batch of rows is cut into micro-batches: a fixed number of rows each, or a token budget (verl's
`use_dynamic_bsz` with `ppo_max_token_len_per_gpu`, `log_prob_max_token_len_per_gpu`).

A micro-batch only bounds memory: each micro-batch's loss is divided by the whole mini-batch's counts
(stages/trainer/step.py), so the update does not depend on the cut (tests/unit/test_micro_batches.py checks it in
every loss_agg_mode).

The token budget cuts as verl's `rearrange_micro_batches`: as few micro-batches as the budget allows,
ceil(tokens / budget), among which the rows are shared by the differencing method (stages/trainer/balance.py with
free row counts) on verl's cost of a row of L tokens, 24576 L + L^2 (a 7B model's linear layers and its attention);
one more micro-batch at a time until every one holds at most the budget. A row is never split, so a row longer than
the budget is an error that names the key to raise. With fixed-size micro-batches a batch of long-tailed lengths
pads every micro-batch to its longest row; with a budget (and packing, stages/trainer/packing.py) each micro-batch
holds about the same number of real tokens.

Data-parallel ranks must run the same number of passes (under FSDP each pass is a collective): with a budget,
`at_least` cuts a rank's share into as many micro-batches as the rank that needs the most, as verl all-reduces the
count, rather than leaving it idle passes.

Pure Python: the config imports `MicroBatching` without torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stages.trainer.balance import balanced_partitions


def row_cost(tokens: int) -> int:
    """verl's estimate of a row's forward cost: linear in its tokens, plus its attention's square."""
    return 24576 * tokens + tokens * tokens


@dataclass(frozen=True)
class MicroBatching:
    """One pass's cutting rule: `size` rows at a time, or (use_dynamic_bsz) at most `max_token_len` tokens."""

    size: int = 32
    use_dynamic_bsz: bool = False
    max_token_len: int = 16384
    budget_key: str = "actor.ppo_max_token_len_per_gpu"  # the key a too-long row's error names

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a micro-batch holds at least one row, not {self.size}")
        if self.max_token_len < 1:
            raise ValueError(f"{self.budget_key} must be >= 1, not {self.max_token_len}")

    def cut(self, lengths: list[int], at_least: int = 1) -> list[list[int]]:
        """Row indices of each micro-batch of rows with these token counts (prompt + response), in order within
        each. With a token budget, at least `at_least` micro-batches when there are that many rows; fixed-size
        micro-batches ignore it (a rank with fewer runs idle passes, as it always has)."""
        if not self.use_dynamic_bsz:
            n, size = len(lengths), self.size
            return [list(range(lo, min(lo + size, n))) for lo in range(0, n, size)]
        return token_budget(lengths, self.max_token_len, at_least, self.budget_key)

    def count(self, lengths: list[int], at_least: int = 1) -> int:
        """How many micro-batches `cut` makes of these rows."""
        return len(self.cut(lengths, at_least))


def common_passes(batching: MicroBatching, shares: list[list[int]]) -> int:
    """The passes every data-parallel rank runs over its share (row lengths each): enough for the share that
    needs the most, every rank cutting its own with at_least=this; a rank that makes fewer runs idle passes."""
    passes = 1
    while True:
        need = max((batching.count(lengths, passes) for lengths in shares), default=0)
        if need <= passes:
            return passes
        passes = need


def token_budget(lengths: list[int], budget: int, at_least: int = 1, key: str = "max_token_len") -> list[list[int]]:
    """Micro-batches of at most `budget` tokens each, their costs balanced (see the module docstring)."""
    if not lengths:
        return []
    longest = max(lengths)
    if longest > budget:
        raise ValueError(
            f"a row of {longest} tokens (prompt + response) does not fit the token budget {key}={budget}: rows are "
            f"never split, so raise {key} to at least the longest prompt + response "
            "(data.max_prompt_length + data.max_response_length)"
        )
    count = min(len(lengths), max(math.ceil(sum(lengths) / budget), at_least, 1))
    costs = [row_cost(n) for n in lengths]
    while True:
        parts = [p for p in balanced_partitions(costs, count, equal_size=False) if p]
        if all(sum(lengths[i] for i in p) <= budget for p in parts) or count == len(lengths):
            return sorted(parts, key=lambda p: p[0])  # in the batch's order of their first rows
        count += 1
