"""TorchTrainer: the plain-torch trainer backend (HF causal LM, AdamW, verl's actor loss from stages/trainer/step.py).

It runs in one long-lived Ray actor: the driver hands it each step's samples (already grouped by the training
sink) and asks it to push its weights to the engines every `trigger_parameter_sync_step` steps. Like verl, one
step is `require_batches` mini-batches of `ppo_mini_batch_size` prompts, one optimizer update each; a
mini-batch is split into micro-batches only to bound memory.

The old logprobs of the PPO ratio are, as in verl:
- the engine's behaviour logprobs (`use_rollout_log_probs`, the default);
- or, with `compute_prox_log_prob` (or `use_rollout_log_probs=false`), the proximal logprobs: recomputed with the
  weights at the start of the step, for every mini-batch before the first update. Rollout correction
  (stages/trainer/correction.py) then weighs and masks samples by proximal / behaviour: decoupled PPO.

A mini-batch is cut into micro-batches of `micro_batch_size` rows or by a token budget (`use_dynamic_bsz`,
stages/trainer/micro_batches.py); each is right-padded or packed into one row (`model.use_remove_padding`,
stages/trainer/packing.py), its decoder layers optionally checkpointed, and the parameters and optimizer state
optionally parked in CPU memory between steps (stages/trainer/offload.py): ExecutionSettings, none of which changes
the update.

With `actor.router_replay.mode=R3` every forward pass of a step, the proximal one included (as verl's R3), replays
the engine's MoE routes (stages/trainer/hf_router_replay.py).

Built with a `DPRank` of size > 1 (`actor.fsdp_config.fsdp_size`), a TorchTrainer is one FSDP2 rank
(stages/trainer/fsdp.py) driven by stages/trainer/fsdp_backend.py's FSDPTrainer: it trains its share of each
mini-batch (`train_shares`), computes logprobs of its share (`share_logprobs`) and takes part in every gather of an
export or checkpoint. Every pass over the model is a collective then, so each call runs the number of passes it is
told, idle ones (a one-token forward, a zero loss) on a rank whose share is shorter.
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from stages.handoff import StepRows, rows_of
from stages.trainer import fsdp
from stages.trainer.balance import row_tokens
from stages.trainer.fsdp import DPRank, Share
from stages.trainer.hf_router_replay import HFRouterReplay
from stages.trainer.loss import TokenForward, entropy_from_logits
from stages.trainer.lr_schedule import apply_lr
from stages.trainer.offload import Offload
from stages.trainer.packing import packed_forward, use_packed_attention
from stages.trainer.precision import MixedPrecision, autocast, compute_dtype, pick_device, set_threads, to_dtype
from stages.trainer.ranks import node_address
from stages.trainer.settings import CorrectionSettings, ExecutionSettings, PolicySettings, correction_mode_error
from stages.trainer.step import (
    ROUTES_COLUMN,
    Minibatch,
    StepTotals,
    check_routes,
    micro_batched_logprobs,
    proximal_step,
)
from stages.trainer.weight_sync import SendsWeights
from stages.transports import WeightMeta, make_sender


class TorchTrainer(SendsWeights):
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
        data_parallel: DPRank | None = None,
        execution: ExecutionSettings | None = None,
        model_dtype: str = "fp32",
        mixed_precision: MixedPrecision | None = None,
        device: str | None = None,
    ) -> None:
        """`optimizer_state`: a saved optimizer state (a checkpoint's optimizer.pt) to continue from, as a
        single-process trainer saves it (a sharded trainer saves it gathered, so either reads either's).
        `data_parallel`: this process's FSDP rank (stages/trainer/fsdp_backend.py starts them); None: no group.
        `execution`: packing, the proximal pass's micro-batches, activation checkpointing and offload.
        `model_dtype`, `mixed_precision`: the weights' and the forward's dtypes (stages/trainer/precision.py).
        `device`: where to compute; None: the GPU this process sees, else the CPU."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        set_threads(torch_threads)
        self.policy = policy or PolicySettings()
        self.dp = data_parallel or DPRank()
        self.device = pick_device(device)
        fsdp.join(self.dp, self.device)
        mixed_precision = mixed_precision or MixedPrecision()
        self.compute_dtype = compute_dtype(mixed_precision.param_dtype, self.device)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=to_dtype(model_dtype)).to(self.device)
        self.model.train()
        self.execution = execution or ExecutionSettings()
        if self.execution.enable_gradient_checkpointing:  # before sharding: FSDP2 wraps the checkpointed layers
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.execution.use_remove_padding:
            use_packed_attention(self.model)
        if self.dp.sharded:
            reduce_dtype = to_dtype(mixed_precision.reduce_dtype)
            fsdp.shard_model(self.model, self.dp, self.device, self.compute_dtype, reduce_dtype)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.policy.lr,
            weight_decay=self.policy.weight_decay,
            betas=tuple(self.policy.optim.betas),
        )
        if optimizer_state:
            self.load_optimizer_state(torch.load(optimizer_state, weights_only=True, map_location="cpu"))
        self.offload = Offload(
            self.model, self.optimizer, self.device, self.execution.param_offload, self.execution.optimizer_offload
        )
        self.log_prob_batching = self.execution.log_prob or self.policy.batching
        self.model_dir = Path(model_dir)
        self.correction = rollout_correction or CorrectionSettings()
        self.recompute = compute_prox_log_prob or not use_rollout_log_probs
        error = correction_mode_error(self.correction, self.recompute, self.policy.policy_loss.loss_mode)
        if error:
            raise ValueError(error)
        self.pad = self.model.config.pad_token_id or 0
        self.replay = HFRouterReplay(self.model) if self.policy.router_replay.active else None
        self.sender = make_sender(weight_sync_backend, node_address())

    # --- training --------------------------------------------------------------------------------------------
    def train_step(self, minibatches: StepRows | list[dict[str, list]]) -> dict[str, float]:
        """One trainer step: an optimizer update per mini-batch. Each mini-batch maps column -> list of rows."""
        totals = StepTotals(self.policy, lr=apply_lr(self.optimizer, self.policy.optim, self.policy.lr))
        minibatches = rows_of(minibatches)  # fetched from the object store here, not through the driver
        with self.offload.active():
            return self._train_step(minibatches, totals)

    def _train_step(self, minibatches: list[dict[str, list]], totals: StepTotals) -> dict[str, float]:
        # The proximal anchor is the weights at the start of the step: all of it before the first update.
        anchors: list = [None] * len(minibatches)
        corrections: list[tuple[list | None, torch.Tensor | None]] = [(None, None)] * len(minibatches)
        correction_metrics: dict[str, float] = {}
        if self.recompute:  # decoupled PPO: the ratio is against the proximal policy, IS against behaviour
            spi = bool(self.policy.trainer_baseline)
            anchors = [
                self.logprobs(mb["prompt_ids"], mb["response_ids"], self._routes(mb), sum_pi2=spi) for mb in minibatches
            ]
            minibatches, anchors, corrections, correction_metrics = proximal_step(
                minibatches, anchors, self.correction, self.policy.trainer_baseline
            )
        bypass = None if self.recompute else self.correction  # the bypass_mode loss corrects inside itself
        for rows, anchor, (masks, weights) in zip(minibatches, anchors, corrections, strict=True):
            self._update(Minibatch.of(rows, self.policy, anchor, masks, weights, bypass=bypass), totals)
        return correction_metrics | totals.metrics()

    def train_shares(self, shares: list[Share]) -> StepTotals:
        """A data-parallel rank's part of a step: an update per mini-batch from its share of the rows; returns its
        sums, which the caller adds up over the ranks (StepTotals.add_rank)."""
        totals = StepTotals(self.policy, lr=apply_lr(self.optimizer, self.policy.optim, self.policy.lr))
        bypass = None if self.recompute else self.correction
        with self.offload.active():
            for share in shares:
                rows, anchor, masks, weights = share.rows, share.anchor, share.masks, share.is_weights
                mb = Minibatch.of(rows, self.policy, anchor, masks, weights, share.counts, bypass)
                self._update(mb, totals, share.micro_batches)
        return totals

    def _update(self, mb: Minibatch, totals: StepTotals, passes: int = 0) -> None:
        """One optimizer update; `passes`: forward/backward passes to run in all, idle ones after the real ones."""
        self.optimizer.zero_grad(set_to_none=True)
        micro = mb.micro_batches(self.policy, at_least=passes)
        for sl in micro:
            res = mb.loss(self._token_logprobs, sl, self.policy, self.device)
            res.total.backward()
            totals.add_micro(res)
        for _ in range(passes - len(micro)):
            (self._idle_logits().sum() * 0.0).backward()  # zero gradients, but FSDP's gathers and reductions run
        grad_norm = float(fsdp.full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.policy.grad_clip)))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # as verl: an update whose gradient overflowed is skipped, not applied
            self.optimizer.zero_grad(set_to_none=True)
        totals.add_update(grad_norm)

    def _routes(self, rows: dict[str, list]) -> list | None:
        """The rows' engine routes when replaying them (checked before the proximal pass uses them)."""
        if self.replay is None:
            return None
        check_routes(rows)
        return rows[ROUTES_COLUMN]

    def _token_logprobs(
        self,
        prompts: list,
        responses: list,
        entropy: bool = False,
        routes: torch.Tensor | None = None,
        sum_pi2: bool = False,
    ) -> TokenForward:
        """Logprob of each response token under the current weights, (B, T), and its distribution's entropy when
        asked (from the same logits; with a graph only when entropy_coeff puts it in the loss). `routes`:
        (B, S, layers * k) MoE routes to replay (stages/trainer/step.py's pad_routes); `sum_pi2`: each token's sum
        of squared probabilities too. Packed into one row with model.use_remove_padding, else right-padded."""
        if routes is not None and self.replay is None:
            raise ValueError("routes given to a trainer built without actor.router_replay")
        if self.execution.use_remove_padding:
            grad = self.policy.entropy_coeff != 0
            precision = autocast(self.device, self.compute_dtype)
            return packed_forward(
                self.model, prompts, responses, self.device, entropy, grad, self.replay, routes, precision, sum_pi2
            )
        seqs = [torch.tensor(np.concatenate([p, r]).astype(np.int64)) for p, r in zip(prompts, responses, strict=True)]
        ids = pad_sequence(seqs, batch_first=True, padding_value=self.pad).to(self.device)  # (B, S)
        attn = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True).to(self.device)
        with self.replay.forcing(routes) if self.replay else contextlib.nullcontext():
            with autocast(self.device, self.compute_dtype):
                logits = self.model(input_ids=ids, attention_mask=attn).logits
        logits = logits.float()  # (B, S, V): logprobs, entropy and the loss in fp32 whatever the forward's dtype
        width = max((len(r) for r in responses), default=0)
        logp = torch.zeros(len(seqs), width, device=self.device)
        mask = torch.zeros(len(seqs), width, device=self.device)
        ent = torch.zeros(len(seqs), width, device=self.device) if entropy else None
        spi = torch.zeros(len(seqs), width, device=self.device) if sum_pi2 else None
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if len(r) == 0:
                continue
            start = len(p) - 1  # logits at position t predict token t + 1
            step_logits = logits[i, start : start + len(r)]  # (T_i, V)
            target = torch.as_tensor(np.asarray(r, np.int64), device=self.device)
            logp[i, : len(r)] = torch.log_softmax(step_logits, -1).gather(-1, target[:, None]).squeeze(-1)
            mask[i, : len(r)] = 1.0
            if ent is not None:
                ent[i, : len(r)] = entropy_from_logits(step_logits, grad=self.policy.entropy_coeff != 0)
            if spi is not None:
                spi[i, : len(r)] = torch.softmax(step_logits, -1).pow(2).sum(-1)
        if self.replay is None:
            return TokenForward(logp, mask, ent, sum_pi2=spi)
        replayed = (self.replay.replayed, self.replay.changed, self.replay.maps())
        return TokenForward(logp, mask, ent, *replayed, sum_pi2=spi)

    @torch.no_grad()
    def logprobs(
        self, prompts: list, responses: list, routes: list | None = None, at_least: int = 1, sum_pi2: bool = False
    ) -> list:
        """Response-token logprobs under the current weights, in micro-batches cut as the proximal pass says
        (proximal anchors; tests); `routes`: the rows' routed_experts to replay; `sum_pi2`: each row as (logprobs,
        sum pi^2) instead."""
        with self.offload.active():
            batching = self.log_prob_batching
            return micro_batched_logprobs(self._token_logprobs, prompts, responses, batching, routes, at_least, sum_pi2)

    @torch.no_grad()
    def share_logprobs(self, shares: list[tuple[dict[str, list], int]], sum_pi2: bool = False) -> list[list]:
        """A data-parallel rank's logprobs of its share of each batch: (rows with prompt_ids, response_ids and,
        replaying routes, routed_experts; the forward passes every rank runs for it)."""
        out = []
        for rows, passes in shares:
            routes = rows[ROUTES_COLUMN] if self.replay is not None else None
            out.append(self.logprobs(rows["prompt_ids"], rows["response_ids"], routes, passes, sum_pi2))
            for _ in range(passes - self.log_prob_batching.count(row_tokens(rows), passes)):
                self._idle_logits()
        return out

    def _idle_logits(self) -> torch.Tensor:
        """A one-token forward: a rank out of rows still joins a pass's parameter gathers (and, backpropagated,
        its gradient reductions)."""
        ids = torch.full((1, 1), self.pad, dtype=torch.long, device=self.device)
        with autocast(self.device, self.compute_dtype):
            return self.model(input_ids=ids).logits.float()

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, url: str) -> float:
        """Write `url`/model (an HF directory, tokenizer included) and `url`/optimizer.pt; returns seconds taken."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            self.model.save_pretrained(local / "model")
            copy_side_files(self.model_dir, local / "model")
            torch.save(self.optimizer_state(), local / "optimizer.pt")
            upload(local, url)
        return time.monotonic() - start

    def optimizer_state(self, keep: bool = True) -> dict | None:
        """The AdamW state_dict as one process holds it: gathered from every rank at DP > 1, where all must call
        this; only those with `keep` get it (the others None)."""
        if not self.dp.sharded:
            return self.optimizer.state_dict()
        return fsdp.gathered_optimizer_state(self.optimizer, keep)

    def load_optimizer_state(self, state: dict) -> None:
        """Continue from a single-process AdamW state_dict (each rank takes its shards of it)."""
        if self.dp.sharded:
            state = fsdp.sharded_optimizer_state(state, list(self.model.parameters()))
        self.optimizer.load_state_dict(state)

    # --- weight sync -------------------------------------------------------------------------------------------
    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """HF names and parameters in the order they are sent; a tied head right after the embedding it shares."""
        weights = list(self.model.named_parameters())
        if self.model.config.tie_word_embeddings:  # vLLM keeps its own head: send it, or it stays stale
            head = self.model.get_output_embeddings().weight
            at = next(i for i, (_, t) in enumerate(weights) if t is head)
            weights.insert(at + 1, ("lm_head.weight", head))
        return weights

    @torch.no_grad()
    def export(self, tied_head: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, each parameter gathered once (the tied head reuses the embedding's gather). At
        DP > 1 every rank must drain this (the gathers are collectives), one parameter at a time; rank 0 sends.
        `tied_head=False`: the parameters alone, as an HF checkpoint stores a tied model."""
        weights = self._named_weights() if tied_head else list(self.model.named_parameters())
        last_param, last = None, None
        for name, param in weights:
            if param is not last_param:
                last_param, last = param, None  # let go of the previous gather before the next
                last = fsdp.full(param.detach())
            yield name, last

    def drain_export(self, tied_head: bool = True) -> int:
        """A non-zero rank's part of an export: take part in every gather, keep nothing."""
        return sum(1 for _ in self.export(tied_head))

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.export()

    def weight_meta(self) -> WeightMeta:
        return WeightMeta.of(self._named_weights())  # a sharded parameter's shape is its full shape

    @torch.no_grad()
    def set_weight(self, name: str, value: float) -> None:
        """Fill one parameter with a constant (tests use it to prove a push changes the engine); at DP > 1 every
        rank fills its shard."""
        fsdp.local(dict(self._named_weights())[name]).fill_(value)


def copy_side_files(model_dir: Path, out: Path) -> None:
    """The tokenizer, config and any other non-weight files the engine needs, where `out` lacks them."""
    for f in model_dir.iterdir():
        if f.is_file() and not (out / f.name).exists() and f.suffix not in (".safetensors", ".bin"):
            if not f.name.endswith(".index.json"):  # a sharded model's weight index names files not written here
                (out / f.name).write_bytes(f.read_bytes())


def upload(local: Path, url: str) -> None:
    """Every file under `local` to the same relative path under `url` (any fsspec URL)."""
    fs, root = fsspec.core.url_to_fs(url)
    for f in sorted(p for p in local.rglob("*") if p.is_file()):
        target = f"{root}/{f.relative_to(local).as_posix()}"
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.put_file(str(f), target)
