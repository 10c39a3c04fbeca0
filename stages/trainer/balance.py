"""Split a mini-batch's rows across data-parallel ranks so that every rank gets about the same number of tokens.

A rank's step time grows with the tokens it runs (prompt + response), and every rank waits for the slowest at the
gradient reduction, so the split balances token counts, as verl's `get_seqlen_balanced_partitions` does for its DP
ranks: the largest differencing method (Karmarkar-Karp) with equal-size partitions. The rows are sorted by length
and taken k at a time, each group one partial k-way partition of singletons; the two partitions with the largest
spread (heaviest minus lightest part) are repeatedly merged, the heaviest part of one with the lightest of the
other, until one partition is left. Each merge joins one part of each, so every part keeps the same row count.

Unlike verl, the row count need not divide by k: the rows are padded with zero-token placeholders up to a multiple
of k, which are dropped afterwards, so the parts' row counts differ by at most one. Every row lands in exactly one
part; each part lists its rows in their original order.

With `equal_size=False` (verl's micro-batch cutting, stages/trainer/micro_batches.py) every row starts as its own
partial partition, one part holding it and k - 1 empty, so the parts' row counts are free and only their sums are
balanced.
"""

from __future__ import annotations

import heapq
import itertools


def balanced_partitions(tokens: list[int], k: int, equal_size: bool = True) -> list[list[int]]:
    """Row indices of each of `k` parts of rows with these token counts (or any other cost): the parts' sums as even
    as the differencing method makes them; with `equal_size` their row counts within one of each other."""
    if k < 1:
        raise ValueError(f"cannot split rows into {k} parts: need k >= 1")
    padded = list(tokens) + [0] * (-len(tokens) % k if equal_size else 0)  # placeholders, dropped at the end
    order = sorted(range(len(padded)), key=lambda i: (padded[i], i))
    tie = itertools.count()  # heap entries never compare their partitions
    heap = []
    for lo in range(0, len(order), k if equal_size else 1):
        parts = [(padded[i], [i]) for i in order[lo : lo + (k if equal_size else 1)]]
        parts += [(0, []) for _ in range(k - len(parts))]
        heapq.heappush(heap, _entry(parts, tie))
    while len(heap) > 1:
        a, b = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        # heaviest with lightest: the two spreads cancel as far as they can
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b), strict=True)]
        heapq.heappush(heap, _entry(merged, tie))
    parts = heap[0][2] if heap else [(0, []) for _ in range(k)]
    return [sorted(i for i in rows if i < len(tokens)) for _, rows in parts]


def _entry(parts: list[tuple[int, list[int]]], tie: itertools.count) -> tuple[int, int, list]:
    """A heap entry that pops the partition with the largest spread first; its parts heaviest first."""
    parts = sorted(parts, key=lambda p: p[0], reverse=True)
    return (-(parts[0][0] - parts[-1][0]), next(tie), parts)


def row_tokens(rows: dict[str, list]) -> list[int]:
    """Each row's context length, prompt and response: what its forward and backward cost."""
    return [len(p) + len(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"], strict=True)]


def take_rows(rows: dict[str, list], index: list[int]) -> dict[str, list]:
    """These rows of every column, in this order."""
    return {column: [values[i] for i in index] for column, values in rows.items()}
