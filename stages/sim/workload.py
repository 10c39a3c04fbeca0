"""The simulated workload behind `stages.sim.generate.SimGenerate` and `trainer.backend: sim`, and its closed forms.

A simulated engine spends wall time instead of compute; everything around it (gate, versions, partial rollout,
sink, audit) is the real pipeline. Times are in simulated seconds; `time_scale` turns them into wall seconds so
that a run of hours takes seconds. The model, kept small on purpose:

- a response's length is drawn once per sample id (log-normal with mean `length_mean`, capped at
  `data.max_response_length`), so every mode of a benchmark sees the very same responses;
- an engine runs `slots` sequences at once; a sequence costs `prefill_s`, then `decode_s_per_token` per token
  whatever else runs (a per-sequence rate: batching is free up to `slots`, impossible beyond);
- a training step costs `train_step_s` per mini-batch plus `train_s_per_token` per response token;
- a weight sync costs `sync_s` plus `sync_bytes` at `sync_gbps`;
- a multi-turn response (`turns` > 1, an agent loop calling a tool) is decoded in `turns` near-equal parts with a
  tool call of `tool_s` between two: the sequence leaves its slot for the call and its next turn is a new request
  (it queues for a slot and pays `prefill_s` again), as an agent loop's next turn is a new request to its server.

`token_unit` simulated tokens travel as one token of the sample logs, so that 28K-token responses stay cheap
to move; the per-token versions are exact at that granularity.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from statistics import NormalDist


@dataclass
class Workload:
    time_scale: float = 0.01
    """Wall seconds per simulated second."""
    token_unit: int = 1
    """Simulated tokens per token in the sample logs."""
    length_mean: float = 32.0
    """Mean response length in simulated tokens, before the cap at data.max_response_length."""
    length_sigma: float = 0.0
    """Shape of the log-normal length distribution; 0 gives every response length_mean tokens."""
    prefill_s: float = 0.0
    """Seconds to prefill one request (paid again when an aborted request resumes)."""
    decode_s_per_token: float = 0.01
    """Seconds per generated token of one sequence."""
    slots: int = 16
    """Sequences one Generate replica runs at once."""
    train_s_per_token: float = 0.0
    """Trainer seconds per response token."""
    train_step_s: float = 0.0
    """Trainer seconds per mini-batch, on top of the per-token time."""
    sync_s: float = 0.0
    """Seconds per weight sync, on top of the transfer."""
    sync_bytes: float = 0.0
    """Bytes per weight sync (the model's weights)."""
    sync_gbps: float = 10.0
    """Weight-sync bandwidth, GB/s."""
    turns: int = 1
    """Assistant turns per response: a multi-turn agent loop with a tool call between two turns."""
    tool_s: float = 0.0
    """Seconds per tool call, spent outside the engine's slots."""
    seed: int = 0
    """Seed of the response lengths."""

    def __post_init__(self) -> None:
        checks = {
            "time_scale": self.time_scale > 0,
            "token_unit": self.token_unit >= 1,
            "length_mean": self.length_mean >= 1,
            "length_sigma": self.length_sigma >= 0,
            "slots": self.slots >= 1,
            "sync_gbps": self.sync_gbps > 0,
            "turns": self.turns >= 1,
            "tool_s": self.tool_s >= 0,
        }
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"sim.{key} = {getattr(self, key)!r} is out of range")

    def response_length(self, sample_id: str, max_tokens: int) -> int:
        """Simulated tokens of one response: the same for a sample id in every run with the same seed."""
        if self.length_sigma == 0:
            return max(1, min(max_tokens, round(self.length_mean)))
        u = (zlib.crc32(f"{self.seed}/{sample_id}".encode()) + 0.5) / 2**32
        mu = math.log(self.length_mean) - self.length_sigma**2 / 2  # the uncapped mean is length_mean
        return max(1, min(max_tokens, round(math.exp(mu + self.length_sigma * NormalDist().inv_cdf(u)))))

    def turn_tokens(self, tokens: int) -> list[int]:
        """The tokens of each assistant turn of a `tokens`-long response: `turns` near-equal parts, fewer when the
        response is shorter than that."""
        return split(tokens, max(1, min(self.turns, tokens)))

    def units(self, tokens: int) -> int:
        """Tokens in the sample logs for `tokens` simulated ones."""
        return math.ceil(tokens / self.token_unit)

    def gen_s(self, tokens: int) -> float:
        return self.prefill_s + tokens * self.decode_s_per_token

    def train_s(self, tokens: int, minibatches: int) -> float:
        return minibatches * self.train_step_s + tokens * self.train_s_per_token

    def transfer_s(self) -> float:
        return self.sync_bytes / (self.sync_gbps * 1e9)

    def sync_time_s(self) -> float:
        return self.sync_s + self.transfer_s()


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal whole parts, the larger first."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def tail_utilisation(requests: int, mean_len: float, max_len: float, slots: int) -> float:
    """U_tail: the share of slot-time a synchronous batch spends decoding when its longest response runs to the
    end alone: B·E[L] / (B·E[L] + C·(L_max − E[L]))."""
    work = requests * mean_len
    return work / (work + slots * max(0.0, max_len - mean_len))


def bubble_bound(t_gen: float, t_train: float, t_switch: float, u_tail: float) -> float:
    """S*: the speedup over colocated sync that removing every bubble (the tail and the switch) could give, at
    best: (T_gen/U_tail + T_train + t_switch) / (T_gen + T_train), with T_gen the tail-free generation time."""
    return (t_gen / u_tail + t_train + t_switch) / (t_gen + t_train)
