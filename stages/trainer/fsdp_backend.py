"""FSDPTrainer: the torch trainer backend over `actor.fsdp_config.fsdp_size` data-parallel FSDP2 ranks.

The driver talks to this one object (a Ray actor, like TorchTrainer) through the TrainerBackend calls. It is rank 0
itself (a TorchTrainer with a DPRank, stages/trainer/fsdp.py) and starts the other ranks as Ray actors (`num_cpus=0`,
as the Megatron backend's peers: two actors holding a CPU each deadlock a small machine); every rank runs each call in
the same order, since its forward, backward and gathers are collectives.

A step, for each mini-batch:
- its rows are split across the ranks balanced by token count (stages/trainer/balance.py, verl's balancing);
- with proximal logprobs, each rank computes its share's, and the whole step is corrected here at once, as the
  single-process trainer does, before any update;
- every rank gets the WHOLE mini-batch's aggregation counts (trained tokens, rows, the -norm constant) and the number
  of forward/backward passes to run (the longest share's micro-batches), trains its share, and FSDP sums the
  gradients: the update is the single-process one. The ranks' loss shares and token counts add up to the metrics
  (StepTotals.add_rank), so DP = 2 reports what DP = 1 reports.

Weights leave gathered one parameter at a time (`DTensor.full_tensor()`), every rank taking part and rank 0 sending.
A checkpoint is gathered too: `model/` an HF directory, `optimizer.pt` the AdamW state as one process holds it, so a
checkpoint resumes at any fsdp_size (1 included). Every rank reads model_dir and optimizer.pt from its own disk, so
on a multi-node cluster they must be where every trainer node sees them (as for the Megatron backend's ranks).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from stages.handoff import StepRows, rows_of
from stages.trainer.balance import balanced_partitions, row_tokens, take_rows
from stages.trainer.fsdp import DPRank, Share
from stages.trainer.micro_batches import MicroBatching, common_passes
from stages.trainer.precision import MixedPrecision
from stages.trainer.ranks import RankPlacement, free_port
from stages.trainer.settings import CorrectionSettings, ExecutionSettings, PolicySettings
from stages.trainer.step import (
    ROUTES_COLUMN,
    Minibatch,
    StepTotals,
    check_routes,
    proximal_step,
)
from stages.trainer.torch_backend import TorchTrainer, copy_side_files, upload
from stages.trainer.weight_sync import SendsWeights
from stages.transports import WeightMeta


class FSDPTrainer(SendsWeights):
    def __init__(
        self,
        model_dir: str,
        policy: PolicySettings | None = None,
        use_rollout_log_probs: bool = True,
        compute_prox_log_prob: bool = False,
        rollout_correction: CorrectionSettings | None = None,
        seed: int = 0,
        torch_threads: int = 1,
        optimizer_state: str | None = None,
        weight_sync_backend: str = "gloo",
        fsdp_size: int = 2,
        model_dtype: str = "fp32",
        mixed_precision: MixedPrecision | None = None,
        gpus_per_rank: float = 0.0,
        rank_resources: dict[str, float] | None = None,
        rank_placement: RankPlacement | None = None,
        execution: ExecutionSettings | None = None,
    ) -> None:
        """TorchTrainer's arguments (each rank computes on the GPU Ray gives it, else on the CPU), and `fsdp_size`
        ranks; `gpus_per_rank`, `rank_resources`: what each peer asks Ray for (a share of the trainer nodes' custom
        resource, pipeline/config/placement.py); `rank_placement`: the trainer's nodes (default: all on this one)."""
        import ray

        if fsdp_size < 2:
            raise ValueError(f"FSDPTrainer runs 2 or more ranks, not {fsdp_size}: use TorchTrainer for one")
        self.policy = policy or PolicySettings()
        self.correction = rollout_correction or CorrectionSettings()
        kwargs = dict(
            policy=self.policy,
            use_rollout_log_probs=use_rollout_log_probs,
            compute_prox_log_prob=compute_prox_log_prob,
            rollout_correction=self.correction,
            seed=seed,
            torch_threads=torch_threads,
            optimizer_state=optimizer_state,
            execution=execution,
            model_dtype=model_dtype,
            mixed_precision=mixed_precision,
        )
        placement = rank_placement or RankPlacement()
        host = placement.host()
        self.size, port = fsdp_size, free_port(host)
        remote_rank = ray.remote(TorchTrainer)
        options = dict(num_cpus=0, num_gpus=gpus_per_rank, resources=rank_resources or {})
        self.peers = [
            remote_rank.options(**options, scheduling_strategy=placement.strategy(r)).remote(
                model_dir, **kwargs, data_parallel=DPRank(r, fsdp_size, port, host)
            )
            for r in range(1, fsdp_size)
        ]
        # Joins the peers' rendezvous; its checks (rollout correction without proximal logprobs) raise here.
        self.rank = TorchTrainer(
            model_dir, **kwargs, weight_sync_backend=weight_sync_backend, data_parallel=DPRank(0, fsdp_size, port, host)
        )
        self.model_dir = Path(model_dir)
        self.sender = self.rank.sender  # rank 0 sends what the ranks gather together

    def _each(self, method: str, args: list[tuple]) -> list:
        """`method` on every rank with its own arguments (args[r] for rank r); their results in rank order. Peers
        first: they block in the first collective until rank 0 arrives; an error on rank 0 propagates at once."""
        import ray

        pending = [getattr(p, method).remote(*a) for p, a in zip(self.peers, args[1:], strict=True)]
        mine = getattr(self.rank, method)(*args[0])
        return [mine, *ray.get(pending)]

    # --- training --------------------------------------------------------------------------------------------
    def train_step(self, minibatches: StepRows | list[dict[str, list]]) -> dict[str, float]:
        start = time.monotonic()
        minibatches = rows_of(minibatches)  # fetched from the object store here, not through the driver
        parts = [balanced_partitions(row_tokens(mb), self.size) for mb in minibatches]
        n = len(minibatches)
        anchors: list = [None] * n
        corrections: list[tuple[list | None, torch.Tensor | None]] = [(None, None)] * n
        correction_metrics: dict[str, float] = {}
        if self.rank.recompute:  # decoupled PPO: the anchors are the weights at the start of the step
            spi = bool(self.policy.trainer_baseline)
            anchors = self._logprobs([_routed(mb, self.policy) for mb in minibatches], parts, spi)
            # the optimal token baseline, if any, over whole mini-batches before they are shared
            minibatches, anchors, corrections, correction_metrics = proximal_step(
                minibatches, anchors, self.correction, self.policy.trainer_baseline
            )
        plans: list[list[Share]] = [[] for _ in range(self.size)]
        for rows, part, anchor, (masks, weights) in zip(minibatches, parts, anchors, corrections, strict=True):
            # Checked and counted over the whole mini-batch here, before any rank starts a collective.
            counts = Minibatch.of(rows, self.policy, anchor, masks, weights).counts
            passes = self._passes(rows, part, self.policy.batching)
            for r, index in enumerate(part):
                plans[r].append(
                    Share(
                        take_rows(rows, index),
                        _take(anchor, index),
                        _take(masks, index),
                        None if weights is None else weights[index],
                        counts,
                        passes,
                    )
                )
        totals: list[StepTotals] = self._each("train_shares", [(plan,) for plan in plans])
        for other in totals[1:]:
            totals[0].add_rank(other)
        totals[0].started = start
        return correction_metrics | totals[0].metrics()

    @staticmethod
    def _passes(rows: dict[str, list], part: list[list[int]], batching: MicroBatching) -> int:
        """The forward/backward passes every rank runs for a mini-batch: the micro-batches of the share that needs
        the most (stages/trainer/micro_batches.py)."""
        tokens = row_tokens(rows)
        return common_passes(batching, [[tokens[i] for i in index] for index in part])

    def _logprobs(self, batches: list[dict[str, list]], parts: list[list[list[int]]], sum_pi2: bool = False) -> list:
        """Each batch's logprobs (with sum pi^2: (logprobs, sum pi^2) rows), each rank computing its part's; rows
        back in the batches' order."""
        shares = [[] for _ in range(self.size)]
        for rows, part in zip(batches, parts, strict=True):
            passes = self._passes(rows, part, self.rank.log_prob_batching)
            for r, index in enumerate(part):
                shares[r].append((take_rows(rows, index), passes))
        results = self._each("share_logprobs", [(s, sum_pi2) for s in shares])
        out = []
        for b, (rows, part) in enumerate(zip(batches, parts, strict=True)):
            merged: list = [None] * len(rows["response_ids"])
            for r, index in enumerate(part):
                for i, row in zip(index, results[r][b], strict=True):
                    merged[i] = row
            out.append(merged)
        return out

    def logprobs(self, prompts: list, responses: list, routes: list | None = None) -> list[list[float]]:
        rows = {"prompt_ids": prompts, "response_ids": responses}
        if routes is not None:
            rows[ROUTES_COLUMN] = routes
        return self._logprobs([rows], [balanced_partitions(row_tokens(rows), self.size)])[0]

    # --- weights out -------------------------------------------------------------------------------------------
    def _stream(self, tied_head: bool = True):
        """Full HF-named tensors from rank 0 while every peer takes part in the same gathers."""
        import ray

        pending = [p.drain_export.remote(tied_head) for p in self.peers]
        yield from self.rank.export(tied_head)
        ray.get(pending)

    def export_weights(self):
        return self._stream()

    def weight_meta(self) -> WeightMeta:
        return self.rank.weight_meta()  # a sharded parameter's shape is its full shape

    def set_weight(self, name: str, value: float) -> None:
        """Fill the parameter with this HF name with a constant (tests): every rank its shard."""
        self._each("set_weight", [(name, value)] * self.size)

    # --- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, url: str) -> float:
        """`url`/model, an HF directory (what the engines and a single-process trainer load), and `url`/optimizer.pt,
        the AdamW state gathered from every rank into the single-process layout; both written by rank 0."""
        from safetensors.torch import save_file

        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            (local / "model").mkdir()
            # An HF checkpoint of a tied model stores the shared tensor once (tied_head=False).
            weights = {name: t.cpu().contiguous().clone() for name, t in self._stream(tied_head=False)}
            save_file(weights, local / "model" / "model.safetensors", metadata={"format": "pt"})
            del weights
            copy_side_files(self.model_dir, local / "model")
            state = self._each("optimizer_state", [(True,)] + [(False,)] * (self.size - 1))[0]
            torch.save(state, local / "optimizer.pt")
            upload(local, url)
        return time.monotonic() - start


def _routed(rows: dict[str, list], policy: PolicySettings) -> dict[str, list]:
    """The columns a proximal pass reads: the tokens and, replaying routes, the engine's routes."""
    if policy.router_replay.active:
        check_routes(rows)
    keep = ["prompt_ids", "response_ids"] + ([ROUTES_COLUMN] if policy.router_replay.active else [])
    return {column: rows[column] for column in keep}


def _take(values: list | None, index: list[int]) -> list | None:
    return None if values is None else [values[i] for i in index]
