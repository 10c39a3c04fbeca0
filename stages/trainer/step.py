"""The parts of a PPO step that do not depend on how a backend runs its model: one mini-batch's rows turned into
masks, anchors, advantages and the aggregation counts; one micro-batch's objective; and a step's metrics.

The objective is verl's actor loss: policy loss - entropy_coeff * entropy + kl_loss_coef * KL(current || ref),
the policy loss being `actor.policy_loss.loss_mode`'s (stages/trainer/policy_loss); the three are aggregated alike
(stages/trainer/loss.py) with the whole mini-batch's denominators, so the micro-batches' gradients add up to the
mini-batch's. TorchTrainer and MegatronRank both call these, so the two backends train the same objective and report
the same metrics by construction; each backend only supplies `token_logprobs` (its forward pass) and its optimizer.

Metrics, under verl's names, over a step of one or more mini-batches (one optimizer update each):
- actor/pg_loss, actor/entropy, actor/kl_loss: each mini-batch's aggregated value (the sum of its micro-batches'
  shares), averaged over the step's mini-batches (verl's legacy actor sums them; one mini-batch per step agrees);
- actor/pg_clipfrac, actor/pg_clipfrac_lower, actor/ppo_kl (as each policy loss defines them; a loss that has
  no such metric in verl reports none), train/ratio_mean: token-weighted over all the step's trained tokens, not a
  mean of micro-batch means; a loss's other metrics (bypass_mode's rollout_corr/*) are means over micro-batches;
- actor/grad_norm: the pre-clip norm, averaged over the step's updates; actor/kl_coef when the KL loss is on;
  actor/lr, the step's learning rate (stages/trainer/lr_schedule.py);
- actor/router_mismatch (with actor.router_replay.mode=R3): the share of replayed (token, MoE layer) pairs whose
  replayed experts are not the set the trainer's own router would pick, over the step's training forward passes;
  actor/router_mismatch_stale the same over the pairs whose routes older weights than the trainer's computed (the
  engine's routes at a previous version; `route_row_versions` says which), logged on the steps that have any.

Routing replay: the `routed_experts` rows (one per context token but the last, layers x k expert ids each) reach a
backend's forward as one (B, S, layers * k) tensor padded to the micro-batch's context length with -1, which means
"no replayed route here, route as the model does" (padding and each sequence's last token).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from stages.trainer.balance import row_tokens
from stages.trainer.correction import correct_minibatches
from stages.trainer.kl import kl_penalty
from stages.trainer.loss import AggCounts, TokenLogprobs, agg_loss
from stages.trainer.micro_batches import MicroBatching
from stages.trainer.policy_loss import LossInputs, PolicyLoss, policy_loss_fn
from stages.trainer.settings import CorrectionSettings, PolicySettings

NEEDED_COLUMNS = ("prompt_ids", "response_ids", "response_logprobs", "response_mask")
ROUTES_COLUMN = "routed_experts"
NO_ROUTE = -1  # a (B, S, layers * k) routes tensor's value where the model routes the token itself
Rows = slice | list[int]  # a micro-batch: a run of the mini-batch's rows, or any of them (a token-budget cut)


@dataclass
class MicroLoss:
    total: torch.Tensor  # what the backend backpropagates: pg - entropy_coeff * entropy + kl_coef * kl
    pg: PolicyLoss
    entropy: float  # this micro-batch's share of the mini-batch's aggregated entropy
    kl: float  # its share of the aggregated KL loss (0 when the KL loss is off)
    routes_replayed: float = 0.0  # (token, MoE layer) pairs whose experts were replayed
    routes_changed: float = 0.0  # of them, those whose experts differ from the trainer's own top-k
    stale_replayed: float = 0.0  # the same two counts over the routes computed by older weights than the trainer's
    stale_changed: float = 0.0


@dataclass
class Minibatch:
    """One optimizer update's rows: `masks` are the trained tokens (after any rejection), `old` the PPO anchors."""

    rows: dict[str, list]
    masks: list[np.ndarray]
    old: list
    counts: AggCounts  # the whole mini-batch's: every micro-batch divides by them
    is_weights: torch.Tensor | None = None  # (B, T) rollout-correction weights, None without `rollout_is`
    bypass: CorrectionSettings | None = None  # bypass mode's correction, which the bypass_mode loss computes

    @classmethod
    def of(
        cls,
        rows: dict[str, list],
        policy: PolicySettings,
        anchor: list | None = None,
        masks: list | None = None,
        is_weights: torch.Tensor | None = None,
        counts: AggCounts | None = None,
        bypass: CorrectionSettings | None = None,
    ) -> Minibatch:
        """`counts`: the aggregation's counts when they span more than these rows (data-parallel ranks pass the
        global ones and dp_size); by default this mini-batch's own. `bypass`: the rollout correction the
        bypass_mode loss applies (the anchor being the engine's logprobs)."""
        missing = [c for c in NEEDED_COLUMNS if c not in rows]
        if "token_advantages" not in rows and "advantage" not in rows:
            missing.append("token_advantages (or advantage)")
        if missing:
            raise KeyError(f"the trainer needs columns {missing}")
        if policy.use_kl_loss:
            _check_ref_logprobs(rows)
        if policy.router_replay.active:
            check_routes(rows)
        masks = masks if masks is not None else [np.asarray(m, dtype=np.float32) for m in rows["response_mask"]]
        if counts is None:
            width = max((len(r) for r in rows["response_ids"]), default=1)  # verl's null: the padded width
            counts = AggCounts(
                tokens=float(sum(m.sum() for m in masks)),
                sequences=float(len(rows["response_ids"])),
                scale_factor=float(policy.loss_scale_factor or width),
            )
        old = anchor if anchor is not None else rows["response_logprobs"]
        return cls(rows, masks, old, counts, is_weights, bypass)

    def slices(self, micro: int) -> list[slice]:
        return [slice(lo, lo + micro) for lo in range(0, len(self.rows["response_ids"]), micro)]

    def micro_batches(self, policy: PolicySettings, at_least: int = 1) -> list[list[int]]:
        """The rows of each micro-batch, cut as the policy says (micro_batch_size rows, or a token budget with
        use_dynamic_bsz; stages/trainer/micro_batches.py); `at_least`: the passes another rank runs."""
        return policy.batching.cut(row_tokens(self.rows), at_least)

    def loss(self, token_logprobs: TokenLogprobs, sl: Rows, policy: PolicySettings, device="cpu") -> MicroLoss:
        """Micro-batch `sl`'s share of the mini-batch's objective."""
        rows = self.rows
        prompts, responses = pick(rows["prompt_ids"], sl), pick(rows["response_ids"], sl)
        replay = self.replay_kwargs(sl, policy)
        fwd = token_logprobs(prompts, responses, entropy=True, **replay)  # (B, T) each
        width = fwd.logp.shape[1]
        old = self._pad(pick(self.old, sl), width, device)
        mask = fwd.mask * self._pad(pick(self.masks, sl), width, device)
        w = None if self.is_weights is None else self.is_weights[sl, :width].to(device)
        agg, den = policy.loss_agg_mode, self.counts.denominator(policy.loss_agg_mode)
        x = LossInputs(fwd.logp, old, self._advantages(sl, width, device), mask, self.counts, agg, w, self.bypass)
        pg = PolicyLoss.of(policy_loss_fn(policy.policy_loss)(x, policy), x)
        entropy = agg_loss(fwd.entropy, mask, agg, den)
        total = pg.loss - policy.entropy_coeff * entropy if policy.entropy_coeff else pg.loss
        kl = torch.zeros(())
        if policy.use_kl_loss:
            ref = self._pad(pick(rows["ref_logprobs"], sl), width, device)
            kl = agg_loss(kl_penalty(fwd.logp, ref, policy.kl_loss_type), mask, agg, den)
            total = total + policy.kl_loss_coef * kl
        stale = self._stale_route_counts(sl, fwd.route_maps)
        return MicroLoss(
            total, pg, float(entropy.detach()), float(kl.detach()), fwd.routes_replayed, fwd.routes_changed, *stale
        )

    def _stale_route_counts(self, sl: Rows, maps: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[float, float]:
        """(replayed, changed) (token, MoE layer) pairs over the context tokens whose routes older weights than the
        trainer's computed (`trainer_version`: the step's version, Step.minibatches)."""
        rows = self.rows
        if maps is None or "trainer_version" not in rows or "routes_version" not in rows:
            return 0.0, 0.0
        replayed, changed = maps
        stale = torch.zeros_like(replayed, dtype=torch.bool)
        for i, (p, versions, base, now) in enumerate(
            zip(
                pick(rows["prompt_ids"], sl),
                pick(rows["token_param_version"], sl),
                pick(rows["routes_version"], sl),
                pick(rows["trainer_version"], sl),
                strict=True,
            )
        ):
            row_versions = torch.as_tensor(route_row_versions(len(p), versions, base))
            stale[i, : len(row_versions)] = row_versions < now
        return float(replayed[stale].sum()), float(changed[stale].sum())

    def replay_kwargs(self, sl: Rows, policy: PolicySettings) -> dict[str, torch.Tensor]:
        """What a forward over micro-batch `sl` takes besides the tokens: `routes` (B, S, layers * k) to replay
        with routing replay on, nothing otherwise."""
        if not policy.router_replay.active:
            return {}
        rows = self.rows
        return {
            "routes": pad_routes(
                pick(rows["prompt_ids"], sl), pick(rows["response_ids"], sl), pick(rows[ROUTES_COLUMN], sl)
            )
        }

    def _advantages(self, sl: Rows, width: int, device) -> torch.Tensor:
        """(B, T) per-token advantages; a scalar `advantage` broadcast over the response when the batch has no
        `token_advantages` (sample logs written before the column, hand-built batches)."""
        if "token_advantages" in self.rows:
            return self._pad(pick(self.rows["token_advantages"], sl), width, device)
        adv = torch.tensor(np.asarray(pick(self.rows["advantage"], sl), np.float32), device=device)
        return adv[:, None].expand(-1, width)

    @staticmethod
    def _pad(rows: list, width: int, device) -> torch.Tensor:
        return pad_rows([np.asarray(x, np.float32) for x in rows], width).to(device)


def check_routes(rows: dict[str, list]) -> None:
    """Routing replay needs every row's engine routes, one per context token but the last."""
    n = len(rows["response_ids"])
    routes = rows.get(ROUTES_COLUMN, [None] * n)
    lacking = sum(r is None for r in routes)
    if lacking:
        raise KeyError(
            f"actor.router_replay.mode=R3 replays the engine's MoE routes from the {ROUTES_COLUMN} column, and "
            f"{lacking} of {n} rows of this mini-batch lack it: turn route capture on in the engine "
            "(rollout.enable_rollout_routing_replay=true, verl's key) or set actor.router_replay.mode=disabled"
        )
    for i, (p, r, route) in enumerate(zip(rows["prompt_ids"], rows["response_ids"], routes, strict=True)):
        if len(route) != len(p) + len(r) - 1:
            raise ValueError(
                f"row {i}: {ROUTES_COLUMN} has {len(route)} rows for {len(p)} prompt + {len(r)} response tokens; "
                "it needs one per token but the last (the engine's routes must cover prompt_ids + response_ids)"
            )


def route_row_versions(prompt_len: int, token_versions: list[int], routes_version: int | None) -> np.ndarray:
    """The weight version that computed each routed_experts row of a sample (one per context token but the last).

    Row t is context token t fed to the model, which predicts token t + 1. The latest request's prefill computed
    every row of its context at `routes_version`; the rows it fed while decoding came from the weights that sampled
    the token they predict (keep mode's frozen requests span versions that way). Without `routes_version` (samples
    logged before the column) a row gets the version of the token it predicts, the prompt's the first token's."""
    versions = np.asarray(token_versions, np.int64)
    if len(versions) == 0:
        return np.zeros(0, np.int64)
    predicted = np.arange(prompt_len + len(versions) - 1) + 1 - prompt_len  # response index of the token after
    row = versions[np.clip(predicted, 0, None)]
    return row if routes_version is None else np.maximum(row, routes_version)


def pad_routes(prompts: list, responses: list, routes: list) -> torch.Tensor:
    """(B, S, layers * k) int64 replayed expert ids, S the longest context; NO_ROUTE where none (padding, last)."""
    rows = [np.asarray([np.asarray(t, np.int64) for t in r], np.int64) for r in routes]  # (T_i, layers * k) each
    width = next((r.shape[1] for r in rows if r.ndim == 2), 0)
    context = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    out = torch.full((len(rows), context, width), NO_ROUTE, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(r) and (r.ndim != 2 or r.shape[1] != width):
            raise ValueError(f"{ROUTES_COLUMN} rows hold {width} expert ids per token, but row {i} does not")
        if len(r):
            out[i, : len(r)] = torch.from_numpy(r)
    return out


def _check_ref_logprobs(rows: dict[str, list]) -> None:
    lacking = len(rows["response_ids"]) if "ref_logprobs" not in rows else sum(r is None for r in rows["ref_logprobs"])
    if lacking:
        raise KeyError(
            f"actor.use_kl_loss needs the ref_logprobs column (each response token's logprob under the reference "
            f"policy), and {lacking} of {len(rows['response_ids'])} rows of this mini-batch lack it: add the "
            "stage that writes it (stages.ref_logprob.RefLogprob) or set actor.use_kl_loss=false"
        )


@dataclass
class StepTotals:
    """Sums over a step's mini-batches, turned into the metrics both backends report (see the module docstring)."""

    policy: PolicySettings
    started: float = field(default_factory=time.monotonic)
    updates: int = 0
    shares: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("pg", "entropy", "kl", "grad_norm"), 0.0))
    token_sums: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(
            ("ratio", "tokens", "routes_replayed", "routes_changed", "stale_replayed", "stale_changed"), 0.0
        )
    )
    pg_sums: dict[str, float] = field(default_factory=dict)  # per-token metrics the policy loss reports: their sums
    pg_metrics: dict[str, list[float]] = field(default_factory=dict)  # its other metrics, one value per micro-batch
    lr: float | None = None  # the step's learning rate (actor/lr), when the backend schedules one

    def add_micro(self, res: MicroLoss) -> None:
        self.shares["pg"] += res.pg.loss.detach().item()
        self.shares["entropy"] += res.entropy
        self.shares["kl"] += res.kl
        for key, value in res.pg.sums.items():
            self.pg_sums[key] = self.pg_sums.get(key, 0.0) + value
        for key, value in res.pg.metrics.items():
            self.pg_metrics.setdefault(key, []).append(value)
        for key, value in (
            ("ratio", res.pg.ratio_sum),
            ("tokens", res.pg.tokens),
            ("routes_replayed", res.routes_replayed),
            ("routes_changed", res.routes_changed),
            ("stale_replayed", res.stale_replayed),
            ("stale_changed", res.stale_changed),
        ):
            self.token_sums[key] += value

    def add_update(self, grad_norm: float) -> None:
        self.updates += 1
        self.shares["grad_norm"] += grad_norm

    def add_rank(self, other: StepTotals) -> None:
        """Another data-parallel rank's sums over its shares of the same mini-batches: its loss shares (each
        already divided by the whole mini-batch's denominator) and token counts add up; the grad norm and the
        update count are the whole model's, the same on every rank, so they are counted once."""
        for key in ("pg", "entropy", "kl"):
            self.shares[key] += other.shares[key]
        for key, value in other.token_sums.items():
            self.token_sums[key] += value
        for key, value in other.pg_sums.items():
            self.pg_sums[key] = self.pg_sums.get(key, 0.0) + value
        for key, values in other.pg_metrics.items():
            self.pg_metrics.setdefault(key, []).extend(values)

    def metrics(self) -> dict[str, float]:
        n, tokens = max(self.updates, 1), max(self.token_sums["tokens"], 1.0)
        out = {
            "actor/pg_loss": self.shares["pg"] / n,
            "actor/entropy": self.shares["entropy"] / n,
            "actor/kl_loss": self.shares["kl"] / n,
            "actor/grad_norm": self.shares["grad_norm"] / n,
            **{key: value / tokens for key, value in self.pg_sums.items()},
            **{key: sum(values) / len(values) for key, values in self.pg_metrics.items()},
            "train/ratio_mean": self.token_sums["ratio"] / tokens,
            "train/num_tokens": float(self.token_sums["tokens"]),
            "timing/train_s": time.monotonic() - self.started,
        }
        if self.lr is not None:
            out["actor/lr"] = self.lr
        if self.policy.use_kl_loss:
            out["actor/kl_coef"] = self.policy.kl_loss_coef
        if self.policy.router_replay.active:
            sums = self.token_sums
            out["actor/router_mismatch"] = sums["routes_changed"] / max(sums["routes_replayed"], 1)
            if sums["stale_replayed"]:  # only a step with routes from older weights than the trainer's has it
                out["actor/router_mismatch_stale"] = sums["stale_changed"] / sums["stale_replayed"]
        return out


def micro_batched_logprobs(
    token_logprobs: TokenLogprobs,
    prompts: list,
    responses: list,
    batching: MicroBatching,
    routes: list | None = None,
    at_least: int = 1,
    sum_pi2: bool = False,
) -> list:
    """Each response's token logprobs, computed a micro-batch at a time (cut by `batching`, `at_least` of them
    with a token budget) by a backend's `token_logprobs`: the proximal anchors of every backend. `routes`: the
    rows' routed_experts, replayed (verl's R3 replays them in this pass too); None routes as the model does.
    `sum_pi2`: each row as (logprobs, sum pi^2) from the same forward (proximal_step separates them)."""
    out: list = [None] * len(responses)
    rows = {"prompt_ids": prompts, "response_ids": responses}
    for index in batching.cut(row_tokens(rows), at_least):
        p, r = pick(prompts, index), pick(responses, index)
        replay = {} if routes is None else {"routes": pad_routes(p, r, pick(routes, index))}
        forward = token_logprobs(p, r, **replay, **({"sum_pi2": True} if sum_pi2 else {}))
        for j, (i, x) in enumerate(zip(index, r, strict=True)):
            logp = forward.logp[j, : len(x)].tolist()
            out[i] = (logp, forward.sum_pi2[j, : len(x)].tolist()) if sum_pi2 else logp
    return out


def proximal_step(minibatches: list, anchors: list, correction: CorrectionSettings, baseline: str) -> tuple:
    """What every backend does after a step's proximal pass: rollout correction over the whole step, then, for the
    optimal token baseline (`baseline` 'otb' or 'tir', whose anchors' rows are (logprobs, sum pi^2)), its
    subtraction. Returns (mini-batches, anchors, per mini-batch (masks, IS weights), correction metrics)."""
    pi2 = None
    if baseline:
        anchors, pi2 = [[r[0] for r in mb] for mb in anchors], [[r[1] for r in mb] for mb in anchors]
    corrections, metrics = correct_minibatches(minibatches, anchors, correction)
    if baseline:
        minibatches = baseline_minibatches(baseline, minibatches, anchors, pi2, corrections)
    return minibatches, anchors, corrections, metrics


def baseline_minibatches(kind: str, minibatches: list, anchors: list, pi2: list, corrections: list) -> list[dict]:
    """The optimal token baseline's half in the trainer (stages/advantage/otb.py): the mini-batches with their
    token_advantages, the stream's returns, replaced by returns minus the baseline, from the proximal pass's logprobs
    and sum pi^2 and rollout correction's masks and IS weights. Groups are whole within a mini-batch."""
    from stages.advantage.otb import subtract_baseline

    out = []
    for rows, anchor, spi, (masks, weights) in zip(minibatches, anchors, pi2, corrections, strict=True):
        masks = rows["response_mask"] if masks is None else masks
        advantages = subtract_baseline(kind, rows["prompt_id"], rows["token_advantages"], masks, anchor, spi, weights)
        out.append({**rows, "token_advantages": advantages})
    return out


def pick(values: list, rows: Rows) -> list:
    """These rows of a column, in this order."""
    return values[rows] if isinstance(rows, slice) else [values[i] for i in rows]


def pad_rows(rows: list[np.ndarray], width: int) -> torch.Tensor:
    """Right-pad ragged rows with zeros into a (B, width) float tensor."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row[:width])
    return out
