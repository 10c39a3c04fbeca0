"""One rank of the Megatron trainer: a megatron-core GPTModel (or one pipeline stage of it), its PPO step, its
weight export.

The ranks form a TP x DP x PP grid in megatron's order (tp-cp-ep-dp-pp: the TP ranks of one stage of a model
replica are consecutive, the pipeline stages the outermost). Every rank runs the same calls in the same order
(SPMD); stages/trainer/megatron_backend.py makes sure of it and gives each data-parallel replica its share of the
rows. Pipeline stages, megatron's schedule and the export across stages: stages/trainer/megatron_pipeline.py and
stages/trainer/megatron_export.py. The replicas' gradients are summed (megatron's DDP with
`calculate_per_token_loss`, so it does not divide by DP): each share's loss is already divided by the whole
mini-batch's counts, so the sum is the single-replica gradient.

The model is built from an HF directory's config.json (Llama/Qwen2: RMSNorm, SwiGLU, RoPE with the model's theta,
GQA, qkv bias for Qwen2) with megatron-core's local layer spec, and its weights are the HF safetensors sharded for
this rank (stages/trainer/megatron_convert.py), so training starts from exactly the weights the engines serve.

On CPU megatron-core trains with four shims (`cpu_shims` in stages/trainer/megatron_pipeline.py):
`torch.cuda.current_device` answers "cpu", an RNG tracker that does not fork CUDA states, no CUDA RNG state around
activation recompute, and an explicit bool causal mask. Its optimizer hard-codes CUDA, so the update is written by
hand: `finish_grad_sync`, `main_grad` -> `grad`, a TP- and PP-aware grad-norm clip, torch AdamW. At PP = 1 the
micro-batches' forward/backward are a plain loop; at PP > 1 megatron's own schedule drives them (three more shims,
stages/trainer/megatron_pipeline.py). A Qwen3-MoE model and routing replay: stages/trainer/megatron_moe.py. The
objective and metrics are TorchTrainer's (stages/trainer/step.py); the entropy of the vocabulary-parallel logits
all-reduces its max and two sums over the TP group. On CUDA megatron's schedule and distributed optimizer run the step
(bench/gpu_check compares it with the CPU step at TP = PP = 1); there the parameters are bf16 by default (`dtype`),
the optimizer's main weights fp32, the logits turned into fp32 first."""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from stages.trainer.loss import AggCounts, TokenForward, entropy_from_logits, sum_pi2_from_logits
from stages.trainer.lr_schedule import apply_lr
from stages.trainer.megatron_convert import ModelShape, hf_to_megatron, load_hf, shard
from stages.trainer.megatron_export import ModelExport
from stages.trainer.megatron_inputs import Inputs, model_inputs
from stages.trainer.megatron_moe import MegatronRouteReplay, layer_spec, moe_config
from stages.trainer.megatron_pipeline import Stage, cpu_build, cpu_shims, scheduled_logprobs, scheduled_update
from stages.trainer.packing import pack_rows, unpack_rows
from stages.trainer.precision import set_threads
from stages.trainer.ranks import LOOPBACK, join_world
from stages.trainer.settings import CorrectionSettings, ExecutionSettings, MegatronRecompute, PolicySettings
from stages.trainer.step import ROUTES_COLUMN, Minibatch, StepTotals, check_routes, micro_batched_logprobs


class MegatronRank:
    def __init__(
        self,
        model_dir: str,
        rank: int,
        world_size: int,
        port: int,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        policy: PolicySettings | None = None,
        seed: int = 0,
        torch_threads: int = 1,
        host: str = LOOPBACK,
        bypass: CorrectionSettings | None = None,
        execution: ExecutionSettings | None = None,
        override_transformer_config: dict | None = None,
        dtype: str | None = None,
    ) -> None:
        """`bypass`: the rollout correction the bypass_mode loss applies (bypass mode); None otherwise.
        `execution`: packing and the proximal pass's micro-batches; `override_transformer_config`: megatron's
        activation recompute keys (recompute_granularity, recompute_method, recompute_num_layers, recompute_modules).
        `dtype` (actor.megatron.dtype): 'bfloat16' or 'float32' parameters; None: bfloat16 on a GPU, float32 on
        CPU. bf16 parameters train with megatron's fp32 main weights and optimizer state, which only its CUDA
        optimizer keeps."""
        from megatron.core import parallel_state

        torch.manual_seed(seed)
        set_threads(torch_threads)
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if dtype == "bfloat16" or (dtype is None and self.cuda) else torch.float32
        if self.dtype == torch.bfloat16 and not self.cuda:
            raise ValueError(
                "actor.megatron.dtype=bfloat16 keeps fp32 main weights in megatron's distributed optimizer, which "
                "needs CUDA: set actor.megatron.dtype=float32 on CPU"
            )
        if not self.cuda:
            cpu_shims()
        join_world("nccl" if self.cuda else "gloo", host, port, rank, world_size)
        tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        parallel_state.initialize_model_parallel(tp, pp)
        self.tp, self.tp_rank = tp, parallel_state.get_tensor_model_parallel_rank()
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.mp_group = parallel_state.get_model_parallel_group()  # TP x PP: one replica's whole model
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.model_dir = Path(model_dir)
        self.shape = ModelShape.from_hf(json.loads((self.model_dir / "config.json").read_text()))
        self.shape.check_tp(tp)
        self.shape.check_pp(pp)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.stage = Stage(pp_rank, pp, self.shape.num_layers, self.shape.tied_embeddings)
        self.policy = policy or PolicySettings()
        self.bypass = bypass
        self.execution = execution or ExecutionSettings()
        self.log_prob_batching = self.execution.log_prob or self.policy.batching
        self.recompute = MegatronRecompute(**(override_transformer_config or {})).transformer_config()
        self.model = self._build(seed)
        self._load()
        self.replay = MegatronRouteReplay(self.model.module, self.shape) if self.policy.router_replay.active else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self._optimizer()
        self.pad = json.loads((self.model_dir / "config.json").read_text()).get("pad_token_id") or 0
        exported = [(self.stage.global_name(n), p) for n, p in self.named_params() if not self.stage.is_tied_copy(n)]
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.weights = ModelExport(exported, self.shape, self.stage, tp, self.tp_rank, self.tp_group, pp_group)

    def _build(self, seed: int):
        from megatron.core import tensor_parallel
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        s = self.shape
        config = TransformerConfig(
            num_layers=s.num_layers,
            hidden_size=s.hidden_size,
            num_attention_heads=s.num_heads,
            num_query_groups=s.num_kv_heads,
            kv_channels=s.head_dim,
            ffn_hidden_size=s.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=s.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=s.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.stage.size,
            pipeline_dtype=self.dtype,
            # The stages exchange each micro-batch's shape: micro-batches are padded only to their own width.
            variable_seq_lengths=self.stage.size > 1,
            # DDP sums the replicas' gradients instead of averaging them: the loss is already a mini-batch mean
            calculate_per_token_loss=True,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,
            use_cpu_initialization=True,
            **self.recompute,
            **moe_config(s, replay=self.policy.router_replay.active),
            # Unused by a dense model (PP > 1 is dense only), but the default, allgather, refuses variable lengths.
            **({"moe_token_dispatcher_type": "alltoall"} if self.stage.size > 1 else {}),
        )
        if self.cuda:
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
        with cpu_build(self.cuda):
            model = GPTModel(
                config,
                layer_spec(config, s),
                vocab_size=s.padded_vocab(self.tp),
                max_sequence_length=s.max_positions,
                pre_process=self.stage.first,
                post_process=self.stage.last,
                share_embeddings_and_output_weights=s.tied_embeddings,
                position_embedding_type="rope",
                rotary_base=s.rope_theta,
            ).to(self.device)
        ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=self.cuda)
        return DistributedDataParallel(config, ddp, model)

    def _optimizer(self):
        """torch AdamW on CPU; on GPU megatron's distributed optimizer with the same hyper-parameters and clip."""
        lr, weight_decay, betas = self.policy.lr, self.policy.weight_decay, tuple(self.policy.optim.betas)
        if not self.cuda:
            return torch.optim.AdamW(self.params, lr=lr, weight_decay=weight_decay, betas=betas)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam",
            lr=lr,
            weight_decay=weight_decay,
            adam_beta1=betas[0],
            adam_beta2=betas[1],
            adam_eps=1e-8,
            clip_grad=self.policy.grad_clip,
            use_distributed_optimizer=True,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,  # fp32 main weights and state for bf16 parameters
        )
        return get_megatron_optimizer(config, [self.model])

    def named_params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This stage's parameters under their names in its GPTModel (layer indices from 0 on every stage)."""
        return self.model.module.named_parameters()

    @torch.no_grad()
    def _load(self) -> None:
        """This rank's shard of every Megatron parameter of its stage, from the HF safetensors."""
        full = hf_to_megatron(load_hf(self.model_dir), self.shape)
        names = {self.stage.global_name(n) for n, _ in self.named_params() if not self.stage.is_tied_copy(n)}
        missing = sorted(names ^ {n for n in full if self.stage.holds(n)})
        if missing:
            raise KeyError(f"HF -> Megatron names do not match the model: {missing[:4]}")
        for local, param in self.named_params():
            name = self.stage.global_name(local)  # a tied copy loads the embedding, sharded as the output layer
            param.copy_(shard(local, full[name], self.tp_rank, self.tp, self.shape))

    # --- forward -------------------------------------------------------------------------------------------------
    def _token_logprobs(
        self,
        prompts: list,
        responses: list,
        entropy: bool = False,
        routes: torch.Tensor | None = None,
        sum_pi2: bool = False,
    ) -> TokenForward:
        """Logprob of each response token (B, T) and, when asked, its entropy and sum pi^2: TorchTrainer's
        contract, routes to replay included (one stage: PP = 1)."""
        batch = self.inputs(prompts, responses)
        return self.read_logits(self.stage_forward(batch, routes), batch, entropy, sum_pi2)

    def inputs(self, prompts: list, responses: list) -> Inputs:
        """Right-padded rows, or one packed row with actor.megatron.use_remove_padding
        (stages/trainer/megatron_inputs.py)."""
        return model_inputs(prompts, responses, self.pad, self.device, self.execution.use_remove_padding)

    def stage_forward(self, batch: Inputs, routes: torch.Tensor | None) -> torch.Tensor:
        """This stage's output: the logits (B, S, V_padded / tp) on the last stage, hidden states on the others
        (whose input megatron's schedule has set)."""
        if routes is not None and self.replay is None:
            raise ValueError("routes given to a trainer built without actor.router_replay")
        if routes is not None and batch.packed:
            routes = pack_rows(routes, batch.lengths)  # (1, N, layers * k), as the tokens
        with self.replay.forcing(routes) if self.replay else contextlib.nullcontext():
            return self.model(batch.ids, batch.positions, batch.causal)

    def read_logits(
        self, logits: torch.Tensor, batch: Inputs, entropy: bool = False, sum_pi2: bool = False
    ) -> TokenForward:
        """The response tokens' logprobs (B, T), and their entropy and sum pi^2 when asked, from the last stage's
        logits."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        responses, ids = batch.responses, batch.ids
        local_vocab = logits.shape[-1]
        vocab_ids = torch.arange(local_vocab, device=self.device) + self.tp_rank * local_vocab
        logits = logits.float().masked_fill(vocab_ids >= self.shape.vocab_size, float("-inf"))  # padding rows
        targets = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # position t predicts token t + 1
        # (B, S) each; first: the cross entropy works in place
        reduce, grad = self._tp_reduce(), self.policy.entropy_coeff != 0
        token_ent = entropy_from_logits(logits, grad, **reduce) if entropy else None
        token_spi = sum_pi2_from_logits(logits, **reduce) if sum_pi2 else None
        token_logp = -vocab_parallel_cross_entropy(logits, targets)  # (B, S)
        width = max((len(r) for r in responses), default=0)
        logp = batch.response_values(token_logp, width)
        mask = batch.response_values(torch.ones_like(token_logp), width)
        ent = batch.response_values(token_ent, width) if entropy else None
        spi = batch.response_values(token_spi, width) if sum_pi2 else None
        if self.replay is None:
            return TokenForward(logp, mask, ent, sum_pi2=spi)
        maps = self.replay.maps()
        if maps is not None and batch.packed:
            maps = tuple(unpack_rows(m, batch.lengths) for m in maps)
        return TokenForward(logp, mask, ent, self.replay.replayed, self.replay.changed, maps, spi)

    def _tp_reduce(self) -> dict:
        """Over a vocabulary split across TP ranks, how a softmax statistic all-reduces its max and its sums (the
        sums forward only, as megatron's own vocab-parallel cross entropy does); nothing at TP = 1."""
        from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

        def reduce_max(t: torch.Tensor) -> torch.Tensor:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.tp_group)
            return t

        def reduce_sum(t: torch.Tensor) -> torch.Tensor:
            return reduce_from_tensor_model_parallel_region(t, self.tp_group)

        return {"reduce_max": reduce_max, "reduce_sum": reduce_sum} if self.tp > 1 else {}

    @torch.no_grad()
    def logprobs(
        self, prompts: list, responses: list, routes: list | None = None, sum_pi2: bool = False
    ) -> list | None:
        """Each response's token logprobs (with `sum_pi2`: (logprobs, sum pi^2) rows); at PP > 1 on the last
        stage, None on the others."""
        if self.stage.size > 1:
            return scheduled_logprobs(self, prompts, responses, sum_pi2)
        batching = self.log_prob_batching
        return micro_batched_logprobs(self._token_logprobs, prompts, responses, batching, routes, 1, sum_pi2)

    # --- training ------------------------------------------------------------------------------------------------
    def train_step(self, minibatches: list[dict[str, list]], recompute: bool = False) -> dict[str, float]:
        """TorchTrainer.train_step's contract: one optimizer update per mini-batch, the same metric keys."""
        return self.train_shares(minibatches, recompute).metrics()

    def train_shares(
        self,
        minibatches: list[dict[str, list]],
        recompute: bool = False,
        counts: list[AggCounts] | None = None,
        corrected: list[tuple] | None = None,
    ) -> StepTotals:
        """One update per mini-batch from this replica's share of its rows; `counts`: the whole mini-batches'
        aggregation counts (every replica divides by them); `corrected`: per mini-batch, this share's proximal
        anchors, rejection-masked token masks and IS weights (the step corrected as a whole by MegatronTrainer),
        else the anchors are computed here when `recompute`. Returns the sums StepTotals.add_rank adds up."""
        totals = StepTotals(self.policy, lr=apply_lr(self.optimizer, self.policy.optim, self.policy.lr))
        if corrected is None:
            corrected = [(self._anchor(mb) if recompute else None, None, None) for mb in minibatches]
        cpu_loop = not self.cuda and self.stage.size == 1
        update = self._update if cpu_loop else functools.partial(scheduled_update, self)
        for i, (rows, (anchor, masks, weights)) in enumerate(zip(minibatches, corrected, strict=True)):
            count = counts[i] if counts else None
            update(Minibatch.of(rows, self.policy, anchor, masks, weights, count, self.bypass), totals)
        return totals

    def _anchor(self, rows: dict[str, list]) -> list:
        """Proximal logprobs; with routing replay, under the engine's routes (as verl's R3)."""
        if self.replay is not None:
            check_routes(rows)
        routes = rows[ROUTES_COLUMN] if self.replay is not None else None
        return self.logprobs(rows["prompt_ids"], rows["response_ids"], routes)

    def _update(self, mb: Minibatch, totals: StepTotals) -> None:
        """The CPU update at PP = 1: the micro-batches' forward/backward in a plain loop."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none=True)
        for sl in mb.micro_batches(self.policy):
            res = mb.loss(self._token_logprobs, sl, self.policy, self.device)
            res.total.backward()
            totals.add_micro(res)
        self.step(totals)

    def step(self, totals: StepTotals) -> None:
        """Reduce the accumulated gradients and step: megatron's optimizer on GPU, torch AdamW on CPU."""
        from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads

        self.model.finish_grad_sync()  # DP all-reduce of the grad buffers (a no-op copy at DP=1)
        # PP > 1 with a tied embedding: the first stage's and the last stage's copy get the sum of both gradients.
        _allreduce_word_embedding_grads([self.model], self.model.config)
        if self.cuda:
            _, grad_norm, _ = self.optimizer.step()
            totals.add_update(float(grad_norm or 0.0))
            return
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        grad_norm = self._clip_grads()
        if math.isfinite(grad_norm):
            self.optimizer.step()  # as verl: an update whose gradient overflowed is skipped
        totals.add_update(grad_norm)

    def _clip_grads(self) -> float:
        """torch's clip_grad_norm_ over the whole model: TP shards count once each, replicated params once, a tied
        embedding's copy on the last stage not at all."""
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.params:
            counted = getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0
            if counted and not getattr(p, "shared", False):
                squares += p.grad.double().pow(2).sum()
        dist.all_reduce(squares, group=self.mp_group)
        norm = float(squares.sqrt())
        coef = self.policy.grad_clip / (norm + 1e-6)
        if coef < 1.0:
            for p in self.params:
                p.grad.mul_(coef)
        return norm

    # --- export --------------------------------------------------------------------------------------------------
    def hf_meta(self) -> dict[str, list]:
        """Names, shapes and dtypes of `export()`'s tensors (the whole model's), without moving any weight."""
        return self.weights.meta()

    def export(self, bucket_bytes: int = 64 << 20) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model's HF-named tensors on rank 0 (stages/trainer/megatron_export.py). Every rank of the
        first replica must drain this generator (its gathers and sends are collectives)."""
        return self.weights.stream(bucket_bytes)

    def drain_export(self, bucket_bytes: int = 64 << 20) -> int:
        """A non-zero rank's part of an export: take part in every gather and send, keep nothing. The other
        data-parallel replicas hold the same weights: they have no part in it."""
        return sum(1 for _ in self.export(bucket_bytes)) if self.dp_rank == 0 else 0

    @torch.no_grad()
    def fill_hf(self, hf_name: str, value: float) -> None:
        """Fill the Megatron parameter that exports as `hf_name` alone (not a fused one) with a constant (tests),
        on whichever stage holds it (both copies of a tied embedding)."""
        source = self.weights.source(hf_name)
        for local, param in self.named_params():
            if self.stage.global_name(local) == source:
                param.fill_(value)

    def optimizer_state(self) -> dict:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
