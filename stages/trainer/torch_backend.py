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

With `actor.router_replay.mode=R3` every forward pass of a step, the proximal one included (as verl's R3), replays
the engine's MoE routes (stages/trainer/hf_router_replay.py).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from stages.trainer.correction import correct_step
from stages.trainer.hf_router_replay import HFRouterReplay
from stages.trainer.loss import TokenForward, entropy_from_logits
from stages.trainer.settings import CorrectionSettings, PolicySettings
from stages.trainer.step import ROUTES_COLUMN, Minibatch, StepTotals, check_routes, micro_batched_logprobs, pad_rows
from stages.trainer.weight_sync import make_weight_sync


class TorchTrainer:
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
    ) -> None:
        """`optimizer_state`: a saved optimizer state (a checkpoint's optimizer.pt) to continue from."""
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        torch.set_num_threads(torch_threads)
        self.policy = policy or PolicySettings()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=self.policy.lr, weight_decay=self.policy.weight_decay
        )
        if optimizer_state:
            self.optimizer.load_state_dict(torch.load(optimizer_state, weights_only=True))
        self.model_dir = Path(model_dir)
        self.correction = rollout_correction or CorrectionSettings()
        self.recompute = compute_prox_log_prob or not use_rollout_log_probs
        if self.correction.active and not self.recompute:
            raise ValueError("rollout correction compares proximal and behaviour logprobs: set compute_prox_log_prob")
        self.pad = self.model.config.pad_token_id or 0
        self.replay = HFRouterReplay(self.model) if self.policy.router_replay.active else None
        self.sync = make_weight_sync(weight_sync_backend)

    # --- training --------------------------------------------------------------------------------------------
    def train_step(self, minibatches: list[dict[str, list]]) -> dict[str, float]:
        """One trainer step: an optimizer update per mini-batch. Each mini-batch maps column -> list of rows."""
        totals = StepTotals(self.policy)
        # The proximal anchor is the weights at the start of the step: all of it before the first update.
        anchors: list = [None] * len(minibatches)
        corrections: list[tuple[list | None, torch.Tensor | None]] = [(None, None)] * len(minibatches)
        correction_metrics: dict[str, float] = {}
        if self.recompute:  # decoupled PPO: the ratio is against the proximal policy, IS against behaviour
            anchors = [self.logprobs(mb["prompt_ids"], mb["response_ids"], self._routes(mb)) for mb in minibatches]
            corrections, correction_metrics = self._correct(minibatches, anchors)
        for rows, anchor, (masks, weights) in zip(minibatches, anchors, corrections, strict=True):
            self._update(Minibatch.of(rows, self.policy, anchor, masks, weights), totals)
        return correction_metrics | totals.metrics()

    def _update(self, mb: Minibatch, totals: StepTotals) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        for sl in mb.slices(self.policy.micro_batch_size):
            res = mb.loss(self._token_logprobs, sl, self.policy)
            res.total.backward()
            totals.add_micro(res)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.policy.grad_clip))
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

    def _correct(self, minibatches: list, anchors: list) -> tuple[list, dict[str, float]]:
        """The whole step corrected at once, as verl corrects a training batch; then each mini-batch's share:
        its rejection-masked token masks and (B, T) IS weights (None without `rollout_is`)."""
        step = correct_step(
            [row for anchor in anchors for row in anchor],
            [row for mb in minibatches for row in mb["response_logprobs"]],
            [row for mb in minibatches for row in mb["response_mask"]],
            self.correction,
        )
        shares, start = [], 0
        for mb in minibatches:
            share = slice(start, start + len(mb["response_ids"]))
            w = None if step.weights is None else step.weights[share]
            shares.append((step.masks[share], None if w is None else pad_rows(w, max(map(len, w), default=0))))
            start = share.stop
        return shares, step.metrics

    def _token_logprobs(
        self, prompts: list, responses: list, entropy: bool = False, routes: torch.Tensor | None = None
    ) -> TokenForward:
        """Logprob of each response token under the current weights, (B, T), and its distribution's entropy when
        asked (from the same logits; with a graph only when entropy_coeff puts it in the loss). `routes`:
        (B, S, layers * k) MoE routes to replay (stages/trainer/step.py's pad_routes)."""
        seqs = [torch.tensor(np.concatenate([p, r]).astype(np.int64)) for p, r in zip(prompts, responses, strict=True)]
        ids = pad_sequence(seqs, batch_first=True, padding_value=self.pad)  # (B, S)
        attn = pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)
        if routes is not None and self.replay is None:
            raise ValueError("routes given to a trainer built without actor.router_replay")
        with self.replay.forcing(routes) if self.replay else contextlib.nullcontext():
            logits = self.model(input_ids=ids, attention_mask=attn).logits.float()  # (B, S, V)
        width = max((len(r) for r in responses), default=0)
        logp = torch.zeros(len(seqs), width)
        mask = torch.zeros(len(seqs), width)
        ent = torch.zeros(len(seqs), width) if entropy else None
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if len(r) == 0:
                continue
            start = len(p) - 1  # logits at position t predict token t + 1
            step_logits = logits[i, start : start + len(r)]  # (T_i, V)
            target = torch.as_tensor(np.asarray(r, np.int64))
            logp[i, : len(r)] = torch.log_softmax(step_logits, -1).gather(-1, target[:, None]).squeeze(-1)
            mask[i, : len(r)] = 1.0
            if ent is not None:
                ent[i, : len(r)] = entropy_from_logits(step_logits, grad=self.policy.entropy_coeff != 0)
        if self.replay is None:
            return TokenForward(logp, mask, ent)
        return TokenForward(logp, mask, ent, self.replay.replayed, self.replay.changed, self.replay.maps())

    @torch.no_grad()
    def logprobs(self, prompts: list, responses: list, routes: list | None = None) -> list[list[float]]:
        """Response-token logprobs under the current weights, in micro-batches (proximal anchors; tests);
        `routes`: the rows' routed_experts to replay."""
        return micro_batched_logprobs(self._token_logprobs, prompts, responses, self.policy.micro_batch_size, routes)

    # --- checkpoints ---------------------------------------------------------------------------------------------
    def save_checkpoint(self, url: str) -> float:
        """Write `url`/model (an HF directory, tokenizer included) and `url`/optimizer.pt; returns seconds taken."""
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp)
            self.model.save_pretrained(local / "model")
            for f in self.model_dir.iterdir():  # tokenizer and any other side files the engine needs
                if f.is_file() and not (local / "model" / f.name).exists() and f.suffix not in (".safetensors", ".bin"):
                    (local / "model" / f.name).write_bytes(f.read_bytes())
            torch.save(self.optimizer.state_dict(), local / "optimizer.pt")
            fs, root = fsspec.core.url_to_fs(url)
            for f in sorted(p for p in local.rglob("*") if p.is_file()):
                target = f"{root}/{f.relative_to(local).as_posix()}"
                fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(f), target)
        return time.monotonic() - start

    # --- weight sync -------------------------------------------------------------------------------------------
    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        weights = list(self.model.named_parameters())
        if self.model.config.tie_word_embeddings:  # vLLM keeps its own head: send it, or it stays stale
            weights.append(("lm_head.weight", self.model.get_output_embeddings().weight))
        return weights

    def open_weight_sync(self, world_size: int, connect_timeout_s: float = 30.0) -> dict[str, Any]:
        return self.sync.open(world_size, connect_timeout_s)

    def wait_weight_sync(self) -> None:
        self.sync.wait_open()

    def weight_meta(self) -> dict[str, list]:
        weights = self._named_weights()
        return {
            "names": [n for n, _ in weights],
            "shapes": [list(t.shape) for _, t in weights],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in weights],
        }

    @torch.no_grad()
    def push_weights(self) -> dict[str, float]:
        start = time.monotonic()
        sent = self.sync.push(t for _, t in self._named_weights())
        return {"sync/bytes": float(sent), "sync/broadcast_s": time.monotonic() - start}

    @torch.no_grad()
    def publish_weights(self, url: str) -> dict[str, float]:
        """Pull mode: write the weights as one safetensors file at `url` (any fsspec URL) for the engines to load."""
        from safetensors.torch import save

        start = time.monotonic()
        blob = save({name: t.detach().contiguous() for name, t in self._named_weights()})
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with fs.open(path, "wb") as f:
            f.write(blob)
        return {"sync/bytes": float(len(blob)), "sync/publish_s": time.monotonic() - start}

    @torch.no_grad()
    def set_weight(self, name: str, value: float) -> None:
        """Fill one parameter with a constant (tests use it to prove a push changes the engine)."""
        dict(self._named_weights())[name].fill_(value)
