"""Draw the tables of pipeline.observe.samples into a matplotlib Axes the caller owns (notebooks lay out figures).

Only Axes methods and matplotlib's default colour cycle ("C0".."C9") are used, so importing this module does not
import matplotlib; the `notebook` extra installs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def reward_curve(curve: pd.DataFrame, ax: Axes, window: int = 10) -> Axes:
    """Mean reward per trainer step, with a rolling mean over `window` steps."""
    ax.plot(curve["consumed_step"], curve["reward_mean"], color="C0", alpha=0.35, label="per step")
    smooth = curve["reward_mean"].rolling(window, min_periods=1).mean()
    ax.plot(curve["consumed_step"], smooth, color="C0", label=f"rolling mean ({window} steps)")
    ax.set(xlabel="trainer step", ylabel="mean reward", title="Reward of trained responses")
    ax.legend(loc="lower right")
    return ax


def lag_histogram(hist: pd.DataFrame, ax: Axes) -> Axes:
    """Trained responses per lag, each bar labelled with its share."""
    bars = ax.bar(hist["lag"], hist["samples"], color="C1")
    ax.bar_label(bars, labels=[f"{s:.0%}" for s in hist["share"]])
    ax.set_xticks(hist["lag"])
    ax.set(xlabel="lag (trainer version - first token's version)", ylabel="trained responses", title="Staleness")
    return ax


def version_spans(spans: pd.DataFrame, ax: Axes, max_samples: int = 25) -> Axes:
    """One horizontal bar per partial response, coloured by the weight version of each run of tokens."""
    ids = list(dict.fromkeys(spans["sample_id"]))[:max_samples]
    for row, sample_id in enumerate(ids):
        runs = spans[spans["sample_id"] == sample_id]
        ax.broken_barh(
            list(zip(runs["start_token"], runs["length"], strict=True)),
            (row - 0.4, 0.8),
            facecolors=[f"C{v % 10}" for v in runs["version"]],
        )
    versions = sorted(spans["version"].unique())
    for v in versions:  # legend entries only; broken_barh takes one label per call
        ax.bar(0, 0, color=f"C{v % 10}", label=f"version {v}")
    ax.set_yticks(range(len(ids)), ids, fontsize="x-small")
    ax.invert_yaxis()
    ax.set(xlabel="response token", title=f"Weight version per token ({len(ids)} partial responses)")
    if versions:
        ax.legend(loc="lower right")
    return ax


def response_lengths(lengths: pd.DataFrame, ax: Axes, bins: int = 30) -> Axes:
    """Histogram of response lengths, stacked by finish reason ('stop' or 'length', i.e. truncated)."""
    reasons = sorted(lengths["finish_reason"].dropna().unique())
    edges = np.histogram_bin_edges(lengths["num_tokens"], bins=bins)
    groups = [lengths.loc[lengths["finish_reason"] == r, "num_tokens"] for r in reasons]
    ax.hist(groups, bins=edges, stacked=True, label=reasons)
    ax.set(xlabel="response tokens", ylabel="responses", title="Response lengths")
    if reasons:
        ax.legend(title="finish reason")
    return ax
