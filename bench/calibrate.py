"""Fit the simulated workload to verl's published 128-GPU Qwen2.5-Math-7B table; prints the numbers of
conf/sim/verl_7b_128gpu.yaml.

The table gives, per step of 512 prompts x 16 responses (max 28K tokens):
  colocated sync, 128 GPUs: gen 177.85 s, old_log_prob 53.92 s + update_actor 113.81 s, step 356.30 s;
  fully async, 64:64:      gen wait 33.14 s, update_actor 113.16 s, step 150.63 s
                           (trigger_parameter_sync_step=4, require_batches=4, staleness 0.5, partial rollout).
Assumed (the table does not say): response lengths log-normal with mean 4000 tokens (sigma 1.0, capped at 28K),
no prefill cost. The batch is scaled down 16x (32 prompts per 512) with the engine slots, which keeps the
requests per slot and so the tail. Fitted: the engine slots, from the async trainer's wait for data, and the
per-sequence decode time, from the colocated generation time. Training and sync times are the table's.

    python -m bench.calibrate
"""

from __future__ import annotations

from pipeline.sim.des import Setting, simulate
from stages.sim.workload import Workload
from stages.staleness import StalenessBudget

SCALE = 16  # prompts per step 512 -> 32
N, MAX_LEN, MEAN, SIGMA = 16, 28000, 4000, 1.0
COLO_GEN, COLO_TRAIN, COLO_STEP = 177.85, 53.92 + 113.81, 356.30
ASYNC_WAIT, ASYNC_TRAIN, ASYNC_STEP = 33.14, 113.16, 150.63
COLO_SWITCH = COLO_STEP - COLO_GEN - COLO_TRAIN  # the rest of a colocated step: resharding, reward, ...
ASYNC_SYNC = ASYNC_STEP - ASYNC_WAIT - ASYNC_TRAIN  # the rest of an async step (4 local updates): the sync, ...
STEPS = 12


def mean_length(work: Workload, samples: int = 20000) -> float:
    return sum(work.response_length(f"m{i}/0", MAX_LEN) for i in range(samples)) / samples


def colocated(work: Workload, slots: int) -> Setting:
    budget = StalenessBudget(
        ppo_mini_batch_size=512 // SCALE, require_batches=1, trigger_parameter_sync_step=1, staleness_threshold=0.0
    )
    return Setting(budget, n=N, max_tokens=MAX_LEN, slots=slots, in_engine=10**6)


def fully_async(work: Workload, slots: int) -> Setting:
    budget = StalenessBudget(
        ppo_mini_batch_size=128 // 4 // SCALE, require_batches=4, trigger_parameter_sync_step=4, staleness_threshold=0.5
    )
    return Setting(budget, n=N, max_tokens=MAX_LEN, slots=slots // 2, in_engine=10**6, pause_mode="abort")


def fit_decode(slots: int) -> float:
    """The per-token decode time that makes the colocated generation phase last COLO_GEN seconds."""
    lo, hi = 1e-4, 0.1
    for _ in range(22):
        mid = (lo + hi) / 2
        work = Workload(length_mean=MEAN, length_sigma=SIGMA, decode_s_per_token=mid)
        gen = simulate(work, colocated(work, slots), STEPS).wall_s / STEPS
        lo, hi = (mid, hi) if gen < COLO_GEN else (lo, mid)
    return (lo + hi) / 2


def async_wait(slots: int, decode: float, train_per_token: float) -> float:
    work = Workload(length_mean=MEAN, length_sigma=SIGMA, decode_s_per_token=decode, train_s_per_token=train_per_token)
    out = simulate(work, fully_async(work, slots), 4 * STEPS)
    return (out.wall_s - out.train_s) / STEPS  # per 512 prompts


def main() -> None:
    tokens_per_step = 512 // SCALE * N * mean_length(Workload(length_mean=MEAN, length_sigma=SIGMA))
    async_per_token = ASYNC_TRAIN / tokens_per_step
    print(f"{'slots (128 GPUs)':>18} {'decode s/token':>15} {'async gen wait s':>17}")
    best = None
    for slots in range(64, 1025, 64):
        decode = fit_decode(slots)
        wait = async_wait(slots, decode, async_per_token)
        print(f"{slots:>18} {decode:>15.6f} {wait:>17.2f}")
        if best is None or abs(wait - ASYNC_WAIT) < abs(best[2] - ASYNC_WAIT):
            best = (slots, decode, wait)
    slots, decode, wait = best
    print(f"\nfit: slots {slots} (colocated; async half), decode_s_per_token {decode:.6f}, async wait {wait:.2f} s")
    print(f"train_s_per_token colocated {COLO_TRAIN / tokens_per_step:.4e}, async {async_per_token:.4e}")
    print(f"sync_s colocated {COLO_SWITCH:.2f} (per step), async {ASYNC_SYNC:.2f} (per sync)")


if __name__ == "__main__":
    main()
