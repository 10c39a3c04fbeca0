"""Generate: n responses per prompt from an async vLLM engine that takes weight updates mid-stream.

Input columns:  prompt_id, prompt_text, prompt_ids, ground_truth, data_source, admitted_version, admitted_time
Output columns: input columns, repeated for each of the n responses (the group stays in one block), plus
                sample_id, response_ids, response_text, response_logprobs, token_param_version, param_version,
                param_version_end, response_mask, num_tokens, num_resumes, finish_reason, replica,
                generated_time, gen_latency_s

Each replica is one Ray Data actor owning one engine. The engine runs on its own event loop thread, so Ray Data's
calls and the control coroutine (weight syncs relayed by the VersionClock) interleave freely: a sync can arrive
while calls are in flight. Per-token versions come from the engine core itself: it labels every output batch
with its weight version (`update_weight_version`), and the final output of a request carries the version spans
over its tokens. That label is exact even for tokens still in transit when the weights change.

At a sync the engine pauses. Without partial rollout it pauses in `wait` mode: requests already in the engine
finish with the old weights and new ones queue until the new weights are in (verl's mode c; harmless in the
synchronous modes, where nothing is in flight). With partial rollout it pauses in `abort` mode: each in-flight
request ends with its partial tokens and logprobs, and is resubmitted at once as prompt + partial tokens with the
remaining token budget; the paused engine queues it, so it continues with the new weights (KV recomputed, as in
verl and AReaL). In `keep` mode the engine freezes its requests and continues them after the update over the KV
cache the old weights computed (PipelineRL's in-flight update). Either way no token is generated twice, none is
lost, and the engine's version spans say which weights sampled each token.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import ray

from schemas import SAMPLE_SCHEMA, require_columns
from schemas.sample import GATE_COLUMNS, GENERATE_COLUMNS, PROMPT_COLUMNS
from stages.engine_busy import EngineBusy

_IN_COLUMNS = [c.name for c in PROMPT_COLUMNS + GATE_COLUMNS]
_OUT_SCHEMA = pa.schema([SAMPLE_SCHEMA.field(c) for c in _IN_COLUMNS + [c.name for c in GENERATE_COLUMNS]])


# The `replica` of the dedicated validation engine's samples; the stream's replicas count from 0.
VALIDATION_REPLICA = -1


def _eos_token_id(model_dir: str) -> int:
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return eos[0] if isinstance(eos, list) else int(eos)
    raise ValueError(f"{model_dir} declares no eos_token_id in generation_config.json or config.json")


class VLLMGenerate:
    def __init__(
        self,
        model_dir: str,
        clock_name: str,
        namespace: str,
        n: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_model_len: int = 256,
        kv_cache_gb: int = 1,
        dtype: str = "float32",
        seed: int = 0,
        pause_mode: str = "wait",
        ignore_eos: bool = False,
        initial_version: int = 0,
        validation_only: bool = False,
    ) -> None:
        """`validation_only`: the dedicated validation engine (async_training.use_trainer_do_validate), outside the
        stream: it joins neither the clock nor the broadcast group, and the driver calls `validate_version`."""
        from transformers import AutoTokenizer

        self.clock = None if validation_only else ray.get_actor(clock_name, namespace=namespace)
        self.replica = VALIDATION_REPLICA if validation_only else ray.get(self.clock.register_replica.remote())
        self.n, self.max_tokens, self.temperature, self.top_p = n, max_tokens, temperature, top_p
        self.eos = _eos_token_id(model_dir)
        if pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause_mode must be 'wait', 'abort' or 'keep', not {pause_mode!r}")
        self.pause_mode = pause_mode  # what a sync does to in-flight requests (module docstring)
        self.ignore_eos = ignore_eos  # fixed-length responses, for benchmarks and tests
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.vocab_size = len(self.tokenizer)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gb)))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True).start()
        engine_seed = seed + (self.replica if self.replica >= 0 else 1_000_003)  # the dedicated one samples apart
        engine_kwargs = dict(model=model_dir, max_model_len=max_model_len, dtype=dtype, seed=engine_seed)
        self.engine = self._run(self._start_engine(engine_kwargs, initial_version))
        self.busy = EngineBusy()  # rollouter/idle_ratio: touched only on the engine loop
        if not validation_only:
            self.control = asyncio.run_coroutine_threadsafe(self._control_loop(), self.loop)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _start_engine(self, kwargs: dict[str, Any], version: int) -> Any:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            skip_tokenizer_init=True,  # token ids in, token ids out: the stage decodes with its own tokenizer
            enforce_eager=True,
            distributed_executor_backend="uni",  # one worker in the engine-core process: fastest start on CPU
            worker_extension_cls="stages.vllm_worker.WeightReceiver",
            **kwargs,
        )
        engine = AsyncLLM.from_engine_args(args)
        await engine.update_weight_version(str(version))  # the weights in model_dir (a checkpoint's on resume)
        self.loaded, self.loaded_changed = version, asyncio.Condition()  # on the engine loop, which uses them
        self.holding = 0  # validation passes that hold new training requests (parallel_validate_and_rollout=false)
        self.one_pass = asyncio.Lock()  # the dedicated engine: one version's pass at a time
        return engine

    async def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, _IN_COLUMNS, "VLLMGenerate")
        rows = batch.select(_IN_COLUMNS).to_pylist()
        for row in rows:  # an out-of-range id kills the engine core: refuse it here, by name
            bad = [t for t in row["prompt_ids"] if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {row['prompt_id']} has token ids {bad[:5]} outside the vocabulary")
        future = asyncio.run_coroutine_threadsafe(self._generate_rows(rows), self.loop)
        out_rows = await asyncio.wrap_future(future)
        return pa.Table.from_pylist(out_rows, schema=_OUT_SCHEMA)

    async def _generate_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Pull mode: prompts admitted at a version this replica has not loaded yet wait for it (the lag bound).
        need = max(row["admitted_version"] for row in rows)
        async with self.loaded_changed:
            await self.loaded_changed.wait_for(lambda: self.loaded >= need and not self.holding)
        jobs = [self._one(row, i) for row in rows for i in range(self.n)]
        return list(await asyncio.gather(*jobs))

    async def _one(self, row: dict[str, Any], index: int) -> dict[str, Any]:
        sample_id = f"{row['prompt_id']}/{index}"
        start = time.time()
        prompt = [int(t) for t in row["prompt_ids"]]
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        resumes = -1
        finish = "abort"
        while finish == "abort":  # only a sync aborts: resume from prompt + partial with the remaining budget
            resumes += 1
            seg_tokens, seg_logprobs, spans, finish = await self._segment(
                prompt + tokens, self.max_tokens - len(tokens), f"{sample_id}#{resumes}"
            )
            tokens += seg_tokens
            logprobs += seg_logprobs
            versions += _expand_spans(spans, len(seg_tokens), sample_id)
        return {
            **row,
            "sample_id": sample_id,
            "response_ids": tokens,
            "response_text": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "response_logprobs": logprobs,
            "token_param_version": versions,
            "param_version": min(versions, default=row["admitted_version"]),
            "param_version_end": max(versions, default=row["admitted_version"]),
            "response_mask": [1] * len(tokens),
            "num_tokens": len(tokens),
            "num_resumes": resumes,
            "finish_reason": finish,
            "replica": self.replica,
            "generated_time": time.time(),
            "gen_latency_s": time.time() - start,
        }

    async def _segment(
        self, prompt: list[int], max_tokens: int, request_id: str, sampling: dict[str, float] | None = None
    ) -> tuple[list, list, Any, str]:
        """Stream one engine request; returns its tokens, logprobs, version spans and finish reason."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = sampling or {"temperature": self.temperature, "top_p": self.top_p}
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=sampling["temperature"],
            top_p=sampling["top_p"],
            logprobs=0,  # the sampled token's logprob: the behaviour policy
            stop_token_ids=[] if self.ignore_eos else [self.eos],  # the engine has no tokenizer: tell it EOS
            output_kind=RequestOutputKind.DELTA,
            ignore_eos=self.ignore_eos,
        )
        tokens: list[int] = []
        logprobs: list[float] = []
        final = None
        request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        self.busy.request_started()
        try:
            async for out in self.engine.generate({"prompt_token_ids": prompt}, params, request_id=request_id):
                final = out.outputs[0]
                tokens.extend(final.token_ids)
                logprobs.extend(step[tok].logprob for step, tok in zip(final.logprobs, final.token_ids, strict=True))
        finally:
            self.busy.request_finished()
        return tokens, logprobs, final.weight_versions, final.finish_reason

    # --- weight syncs, relayed by the VersionClock -----------------------------------------------------------
    async def _control_loop(self) -> None:
        seen = 0
        while True:
            msg = await asyncio.wrap_future(self.clock.next_message.remote(seen).future())
            seen = msg["seq"]
            handlers = {
                "init_group": self._init_group,
                "sync": self._sync,
                "validate": self._validate,
                "load": self._load,
            }
            handler = handlers[msg["kind"]]
            payload = await handler(msg)
            self.clock.ack.remote(seen, self.replica, payload)

    async def _init_group(self, msg: dict[str, Any]) -> dict[str, Any]:
        args = (msg["host"], msg["port"], self.replica + 1, msg["world_size"], msg["backend"])
        await self.engine.collective_rpc("init_weight_group", args=args)
        return {"replica": self.replica}

    async def validate_version(self, msg: dict[str, Any]) -> dict[str, Any]:
        """The dedicated engine's pass: load the version's weight file unless it holds it, then generate every row.
        One pass at a time, so the weights cannot change under a validation request."""

        async def run() -> dict[str, Any]:
            async with self.one_pass:
                if msg["version"] != self.loaded:
                    await self._swap_weights(msg["version"], "load_weights_file", (msg["url"],))
                return await self._validate(msg)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self.loop))

    async def _validate(self, msg: dict[str, Any]) -> dict[str, Any]:
        """This replica's share of a validation pass (pipeline/validate.py); no sync can start until it is done.
        Unless `parallel`, training requests not yet started wait until the share is done."""
        rows = msg["rows"] if self.clock is None else msg["rows"][self.replica :: msg["replicas"]]
        hold = not msg["parallel"] and self.clock is not None
        self.holding += int(hold)
        try:
            jobs = [self._val_one(row, i, msg) for row in rows for i in range(msg["n"])]
            return {"replica": self.replica, "samples": list(await asyncio.gather(*jobs))}
        finally:
            async with self.loaded_changed:
                self.holding -= int(hold)
                self.loaded_changed.notify_all()

    async def _val_one(self, row: dict[str, Any], index: int, msg: dict[str, Any]) -> dict[str, Any]:
        sample_id = f"val-{msg['version']}/{row['prompt_id']}/{index}"
        sampling = {"temperature": msg["temperature"], "top_p": msg["top_p"]}
        start = time.time()
        tokens, _, spans, finish = await self._segment(row["prompt_ids"], self.max_tokens, sample_id, sampling)
        return {
            "sample_id": sample_id,
            "prompt_id": row["prompt_id"],
            "data_source": row["data_source"],
            "ground_truth": row["ground_truth"],
            "response_text": self.tokenizer.decode(tokens, skip_special_tokens=True),
            "num_tokens": len(tokens),
            "token_param_version": _expand_spans(spans, len(tokens), sample_id),
            "finish_reason": finish,
            "replica": self.replica,
            "started_time": start,
            "generated_time": time.time(),
        }

    async def _sync(self, msg: dict[str, Any]) -> dict[str, Any]:
        args = (msg["names"], msg["shapes"], msg["dtypes"])
        return await self._swap_weights(msg["version"], "receive_weights", args)

    async def _load(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Pull mode: load the newest published version, unless this replica already has it."""
        version, url = await asyncio.wrap_future(self.clock.newest_published.remote().future())
        if version <= self.loaded:
            return {"replica": self.replica}
        return await self._swap_weights(version, "load_weights_file", (url,))

    async def _swap_weights(self, version: int, rpc: str, args: tuple) -> dict[str, Any]:
        t0 = time.monotonic()
        # `keep` continues the frozen requests over their KV cache, which must therefore survive the pause.
        await self.engine.pause_generation(mode=self.pause_mode, clear_cache=self.pause_mode != "keep")
        self.busy.pause()  # after the drain: in `wait` mode the engine works until pause_generation returns
        t1 = time.monotonic()
        await self.engine.collective_rpc(rpc, args=args)
        await self.engine.update_weight_version(str(version))
        t2 = time.monotonic()
        await self.engine.resume_generation()
        self.busy.resume()
        async with self.loaded_changed:
            self.loaded = version
            self.loaded_changed.notify_all()
        times = {"pause_s": t1 - t0, "transfer_s": t2 - t1, "resume_s": time.monotonic() - t2}
        return {"replica": self.replica, "version": version, "loaded_at": time.time(), **times, **self.busy.report()}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def _expand_spans(spans: Any, num_tokens: int, sample_id: str) -> list[int]:
    """Per-token versions from the engine's [(version, start, end)] spans."""
    if num_tokens == 0:
        return []
    if not spans:
        raise RuntimeError(f"{sample_id}: the engine reported no weight version for its tokens")
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise RuntimeError(f"{sample_id}: version spans cover {len(versions)} tokens, the response has {num_tokens}")
    return versions
