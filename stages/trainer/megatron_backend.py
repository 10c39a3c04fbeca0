"""MegatronTrainer: the megatron-core trainer backend (`trainer.backend: megatron`).

The driver talks to this one object (a Ray actor, like TorchTrainer) through the TrainerBackend calls. It is rank 0
itself and starts the other `TP x PP x DP - 1` ranks as Ray actors (`num_cpus=0`:
two actors holding a CPU each deadlock a small machine), and makes every rank run each call in the same
order, since the ranks' forward, backward, gradient reductions and weight gathers are collectives. The ranks form
their own torch.distributed world (gloo on CPU, NCCL on GPU), on one node or several (stages/trainer/ranks.py), and
the weight sync to the engines uses a second, private group (stages/transports/group.py), so the two never
collide.

Data parallelism (DP = trainer ranks / TP): each mini-batch's rows are split across the model replicas balanced by
token count (stages/trainer/balance.py, as the FSDP backend and verl do); every replica divides its loss by the
whole mini-batch's counts and megatron's DDP sums the gradients, so DP = 2 trains what DP = 1 trains. The replicas'
loss shares and token counts add up to the step's metrics.

Pipeline parallelism (PP = `pipeline_model_parallel_size`, stages/trainer/megatron_pipeline.py): each replica's
layers are split over PP stages of TP ranks each; the stages' ranks get the same rows, the last stage computes the
losses and logprobs, so a replica's results come from its last stage. Megatron orders the ranks tp-cp-ep-dp-pp:
global rank r is TP rank r % TP of replica (r // TP) % DP in stage r // (TP x DP).

Weights leave as HF names and layout (stages/trainer/megatron_convert.py), gathered across the first replica's TP
ranks in buckets, the later stages' buckets sent to rank 0, and streamed into the weight sync or the pull-mode
safetensors file; the other replicas hold the same weights and skip it. A checkpoint holds the first replica's
optimizer states, one per (stage, TP rank) (every replica's are the same on CPU), so it resumes at any DP size with
the same TP and PP.
"""

from __future__ import annotations

import io
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import torch

from stages.handoff import StepRows, rows_of
from stages.trainer.balance import balanced_partitions, row_tokens, take_rows
from stages.trainer.megatron_rank import MegatronRank
from stages.trainer.ranks import RankPlacement, free_port, node_address
from stages.trainer.settings import CorrectionSettings, ExecutionSettings, PolicySettings, correction_mode_error
from stages.trainer.step import (
    ROUTES_COLUMN,
    Minibatch,
    StepTotals,
    check_routes,
    proximal_step,
)
from stages.trainer.weight_sync import SendsWeights
from stages.transports import WeightMeta, make_sender


def _share(corrected: tuple, index: list[int]) -> tuple:
    """A replica's rows `index` of one mini-batch's (anchors, masks, IS weights), each None when absent."""
    anchor, masks, weights = corrected
    return (
        None if anchor is None else [anchor[i] for i in index],
        None if masks is None else [masks[i] for i in index],
        None if weights is None else weights[index],
    )


def _wait(refs: list) -> list:
    """The peers' results; with TP=1 there are none and Ray is not needed (tests build the trainer in-process)."""
    if not refs:
        return []
    import ray

    return ray.get(refs)


class MegatronTrainer(SendsWeights):
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
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        data_parallel_size: int = 1,
        weight_sync_backend: str = "gloo",
        export_bucket_mb: int = 64,
        dtype: str | None = None,
        gpus_per_rank: float = 0.0,
        rank_resources: dict[str, float] | None = None,
        rank_placement: RankPlacement | None = None,
        execution: ExecutionSettings | None = None,
        override_transformer_config: dict | None = None,
    ) -> None:
        """`data_parallel_size`: model replicas, each of `tensor_model_parallel_size x pipeline_model_parallel_size`
        ranks. `dtype`: the parameters' (MegatronRank). `gpus_per_rank`, `rank_resources`: what each peer rank asks
        Ray for (ray.gpus_per_trainer_rank on a GPU cluster; a share of the trainer nodes' custom resource,
        pipeline/config/placement.py); `rank_placement`: the trainer's nodes (default: all on this one).
        `execution`, `override_transformer_config`: MegatronRank's (packing, the proximal pass's micro-batches;
        activation recompute)."""
        if data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, not {data_parallel_size}")
        policy = policy or PolicySettings()
        self.correction = rollout_correction or CorrectionSettings()
        self.recompute = compute_prox_log_prob or not use_rollout_log_probs
        error = correction_mode_error(self.correction, self.recompute, policy.policy_loss.loss_mode)
        if error:
            raise ValueError(error)
        kwargs = dict(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            policy=policy,
            seed=seed,
            torch_threads=torch_threads,
            bypass=None if self.recompute else self.correction,
            execution=execution,
            override_transformer_config=override_transformer_config,
            dtype=dtype,
        )
        self.tp, self.pp, self.dp = tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size
        placement = rank_placement or RankPlacement()
        kwargs["host"] = placement.host()
        world, port = self.tp * self.pp * self.dp, free_port(kwargs["host"])
        self.peers = []
        if world > 1:
            import ray

            remote_rank = ray.remote(MegatronRank)
            options = dict(num_cpus=0, num_gpus=gpus_per_rank, resources=rank_resources or {})
            self.peers = [
                remote_rank.options(**options, scheduling_strategy=placement.strategy(r)).remote(
                    model_dir, r, world, port, **kwargs
                )
                for r in range(1, world)
            ]
        self.rank = MegatronRank(model_dir, 0, world, port, **kwargs)  # joins the peers' rendezvous
        self.model_dir = Path(model_dir)
        self.bucket_bytes = export_bucket_mb << 20
        self.sender = make_sender(weight_sync_backend, node_address())
        if optimizer_state:
            self._load_optimizer(optimizer_state)

    def _all(self, method: str, *args) -> Any:
        """Run `method` on every rank with the same arguments; rank 0's result."""
        return self._each(method, lambda replica: args)[0]

    def _replica(self, rank: int) -> int:
        return rank // self.tp % self.dp

    def _each(self, method: str, args_of) -> list:
        """Run `method` on every rank with its replica's arguments, `args_of(dp_rank)`; every replica's result from
        the first TP rank of its last stage, in replica order. Peers first: they block in the first collective until
        rank 0 arrives."""
        pending = [getattr(p, method).remote(*args_of(self._replica(r))) for r, p in enumerate(self.peers, start=1)]
        # An error on rank 0 propagates at once: waiting for peers stuck in a collective would turn it into a hang.
        mine = getattr(self.rank, method)(*args_of(0))
        results = [mine, *_wait(pending)]
        last_stage = self.tp * self.dp * (self.pp - 1)
        return results[last_stage :: self.tp][: self.dp]

    # --- training --------------------------------------------------------------------------------------------
    def train_step(self, minibatches: StepRows | list[dict[str, list]]) -> dict[str, float]:
        start = time.monotonic()
        minibatches = rows_of(minibatches)  # fetched from the object store here, not through the driver
        parts = [balanced_partitions(row_tokens(mb), self.dp) for mb in minibatches]
        minibatches, corrected, metrics = self._correct(minibatches)
        # Counted (and checked) over each whole mini-batch here, before any rank starts a collective.
        counts = [Minibatch.of(mb, self.rank.policy, *c).counts for mb, c in zip(minibatches, corrected, strict=True)]
        shares = [[take_rows(mb, part[d]) for mb, part in zip(minibatches, parts, strict=True)] for d in range(self.dp)]
        mine = [[_share(c, part[d]) for c, part in zip(corrected, parts, strict=True)] for d in range(self.dp)]
        totals: list[StepTotals] = self._each("train_shares", lambda d: (shares[d], False, counts, mine[d]))
        for other in totals[1:]:
            totals[0].add_rank(other)
        totals[0].started = start
        return metrics | totals[0].metrics()

    def _correct(self, minibatches: list[dict[str, list]]) -> tuple[list[dict], list[tuple], dict[str, float]]:
        """The mini-batches (with the optimal token baseline subtracted, stages/advantage/otb.py, when the
        estimator is that pair) and per mini-batch (proximal anchors, rejection-masked masks, IS weights): with
        recomputed logprobs, all of them before the first update (the weights at the start of the step) and the step
        corrected at once, as TorchTrainer does; in bypass mode (None, None, None): the engine's logprobs are the
        anchor."""
        if not self.recompute:
            return minibatches, [(None, None, None)] * len(minibatches), {}
        replay = self.rank.policy.router_replay.active
        for mb in minibatches if replay else []:
            check_routes(mb)
        baseline = self.rank.policy.trainer_baseline
        anchors = [
            self.logprobs(mb["prompt_ids"], mb["response_ids"], mb[ROUTES_COLUMN] if replay else None, bool(baseline))
            for mb in minibatches
        ]
        minibatches, anchors, corrections, metrics = proximal_step(minibatches, anchors, self.correction, baseline)
        return minibatches, [(a, m, w) for a, (m, w) in zip(anchors, corrections, strict=True)], metrics

    def logprobs(
        self, prompts: list, responses: list, routes: list | None = None, sum_pi2: bool = False
    ) -> list[list[float]]:
        """Each replica computes its share of the rows (with `sum_pi2`: (logprobs, sum pi^2) rows); they come back
        in the rows' order."""
        rows = {"prompt_ids": prompts, "response_ids": responses} | ({ROUTES_COLUMN: routes} if routes else {})
        part = balanced_partitions(row_tokens(rows), self.dp)
        shares = [take_rows(rows, index) for index in part]
        results = self._each(
            "logprobs",
            lambda d: (shares[d]["prompt_ids"], shares[d]["response_ids"], shares[d].get(ROUTES_COLUMN), sum_pi2),
        )
        merged: list = [None] * len(prompts)
        for index, result in zip(part, results, strict=True):
            for i, row in zip(index, result, strict=True):
                merged[i] = row
        return merged

    # --- weights out -------------------------------------------------------------------------------------------
    def _stream(self):
        """HF-named tensors from rank 0 while every peer takes part in the same bucket gathers."""
        pending = [p.drain_export.remote(self.bucket_bytes) for p in self.peers]
        yield from self.rank.export(self.bucket_bytes)
        _wait(pending)

    def export_weights(self):
        return self._stream()

    def weight_meta(self) -> WeightMeta:
        meta = self.rank.hf_meta()
        return WeightMeta(tuple(meta["names"]), tuple(map(tuple, meta["shapes"])), tuple(meta["dtypes"]))

    def _safetensors(self) -> bytes:
        from safetensors.torch import save

        # safetensors writes one header for all tensors, so the file needs them all at once (on CPU).
        return save({name: t.detach().cpu().contiguous().clone() for name, t in self._stream()})

    @torch.no_grad()
    def set_weight(self, name: str, value: float) -> None:
        """Fill the Megatron parameter behind one HF name with a constant (tests), on every rank."""
        self._all("fill_hf", name, value)

    # --- checkpoints -------------------------------------------------------------------------------------------
    def save_checkpoint(self, url: str) -> float:
        """`url`/model as an HF directory (what the engines and TorchTrainer load) and `url`/optimizer.pt holding
        the AdamW state of every (stage, TP rank) of the first replica, stage-major."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            (local / "model").mkdir()
            (local / "model" / "model.safetensors").write_bytes(self._safetensors())
            for f in self.model_dir.iterdir():  # config.json, tokenizer and any other side files
                if f.is_file() and f.suffix not in (".safetensors", ".bin") and not f.name.endswith(".index.json"):
                    (local / "model" / f.name).write_bytes(f.read_bytes())
            # The first replica's ranks: every replica holds the same state.
            first = [r for r in range(1, self.tp * self.pp * self.dp) if self._replica(r) == 0]
            states = [self.rank.optimizer_state(), *_wait([self.peers[r - 1].optimizer_state.remote() for r in first])]
            buf = io.BytesIO()
            torch.save({"megatron_tp_states": states, "megatron_pp": self.pp}, buf)
            (local / "optimizer.pt").write_bytes(buf.getvalue())
            fs, root = fsspec.core.url_to_fs(url)
            for f in sorted(p for p in local.rglob("*") if p.is_file()):
                target = f"{root}/{f.relative_to(local).as_posix()}"
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(f), target)
        return time.monotonic() - start

    def _load_optimizer(self, path: str) -> None:
        saved = torch.load(path, weights_only=True)
        states = saved.get("megatron_tp_states") if isinstance(saved, dict) else None
        if states is None or len(states) != self.tp * self.pp or saved.get("megatron_pp", 1) != self.pp:
            raise ValueError(
                f"{path} is not an optimizer state of a Megatron trainer with tensor_model_parallel_size={self.tp} "
                f"and pipeline_model_parallel_size={self.pp}: resume with the backend, TP and PP sizes the checkpoint "
                "was taken with (any data-parallel size)"
            )

        def state_of(rank: int) -> dict:  # stage-major: stage rank // (tp * dp), then TP rank rank % tp
            return states[rank // (self.tp * self.dp) * self.tp + rank % self.tp]

        self.rank.load_optimizer_state(states[0])
        _wait([p.load_optimizer_state.remote(state_of(r)) for r, p in enumerate(self.peers, start=1)])
