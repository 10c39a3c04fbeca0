"""Judge: score every response with a generative judge, a frozen LLM served by an engine of its own (verl's GenRM,
an LLM judge), in an actor stage between generation and scoring.

Input columns:  sample_id, prompt_text, response_text, ground_truth, data_source (reward_sources when present)
Output columns: input columns + reward_sources with a 'judge' record for every sample (stages/reward_sources.py);
                its `output` is the judge's verdict text

What the judge reads and how its answer becomes a score are the user's, from one Python file (reward.judge.path):
- `judge_prompt(prompt, response, ground_truth, data_source)` returns the judge's prompt: a string (taken as it is)
  or a list of chat messages (rendered with the judge's own tokenizer's chat template, generation prompt added);
- `judge_score(verdict, prompt, response, ground_truth, data_source)` reads the judge's text and returns a number.
A prompt function or parser that raises, a score that is no number, a prompt longer than the judge takes: that
sample's error, recorded; the run goes on (reward.on_error decides what the sample becomes).

The engine is the Engine interface's (stages/engines/vllm.py), started from `model_dir` and never given other
weights: it joins no weight-sync group and the clock does not know it, so the policy's syncs never touch it. Every
sample of a block is sent at once and the engine batches them; sampling is greedy by default (temperature 0), so a
judge gives the same verdict to the same prompt. An engine that dies ends the run with the cause (a judge that
cannot judge would otherwise fail every sample from then on).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from schemas import require_columns
from stages.engines.base import Engine, Sampling
from stages.reward_sources import record, records_of, with_records
from stages.user_code import load_user_module

_NEEDS = ["sample_id", "prompt_text", "response_text", "ground_truth", "data_source"]
PROMPT_FN, SCORE_FN = "judge_prompt", "judge_score"


class JudgeEngineDied(RuntimeError):
    """The judge's engine is gone: no sample can be judged any more."""


class Judge:
    def __init__(
        self,
        model_dir: str,
        path: str,
        max_tokens: int = 64,
        temperature: float = 0.0,
        max_model_len: int = 512,
        kv_cache_gb: float | None = None,
        seed: int = 0,
        max_attempts: int = 1,
        engine_args: dict[str, Any] | None = None,
        engine: Engine | None = None,
    ) -> None:
        """`model_dir`: the judge's HF model (the policy's starting weights when the config names none); `path`: the
        user's file with judge_prompt and judge_score; `max_attempts`: calls of a sample whose judging failed (its
        prompt, the engine's request or the parser), the first included; `engine`: the Engine to judge with, not
        started (None: a vLLM engine of model_dir)."""
        from transformers import AutoTokenizer

        self.prompt_fn, self.score_fn = judge_functions(path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.max_tokens, self.max_attempts = max_tokens, max_attempts
        self.max_prompt = max_model_len - max_tokens
        self.sampling = Sampling(temperature=temperature)
        if engine is None:
            from stages.engines.vllm import VLLMEngine

            engine = VLLMEngine(model_dir, seed, max_model_len, kv_cache_gb, engine_args=engine_args)
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="judge-engine", daemon=True).start()
        self.calls = 0
        self._run(self.engine.start(0))

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, _NEEDS, "Judge")
        records = records_of(batch)
        rows = batch.select(_NEEDS).to_pylist()
        todo = list(range(len(rows)))
        for attempt in range(1, self.max_attempts + 1):
            results = self._run(self._judge_all([rows[i] for i in todo]))
            failed = []
            for i, (score, error, verdict, took) in zip(todo, results, strict=True):
                spent = records[i]["judge"]["latency_s"] if attempt > 1 else 0.0
                records[i]["judge"] = record(score, error, took + spent, attempt, verdict)
                if error:
                    failed.append(i)
            todo = failed
            if not todo:
                break
        return with_records(batch, records)

    async def _judge_all(self, rows: list[dict[str, Any]]) -> list[tuple]:
        return await asyncio.gather(*(self.judge(row) for row in rows))

    async def judge(self, row: dict[str, Any]) -> tuple[float | None, str | None, str | None, float]:
        """One sample: (score, error, the judge's text, seconds)."""
        t0 = time.monotonic()
        fields = (row["prompt_text"], row["response_text"], row["ground_truth"], row["data_source"])
        ids, error = self.encode(fields)
        if error:
            return None, error, None, time.monotonic() - t0
        self.calls += 1
        try:
            out = await self.engine.generate(
                ids, self.max_tokens, f"judge-{row['sample_id']}-{self.calls}", self.sampling
            )
        except Exception as err:  # noqa: BLE001 - a dead engine ends the run; any other failure is the sample's
            if self.engine.died(err):
                raise JudgeEngineDied(f"the judge's vLLM engine died: {type(err).__name__}: {err}") from err
            return None, f"judge request failed: {type(err).__name__}: {err}"[:500], None, time.monotonic() - t0
        verdict = self.tokenizer.decode(out.tokens, skip_special_tokens=True)
        score, error = call_score(self.score_fn, verdict, fields)
        return score, error, verdict, time.monotonic() - t0

    def encode(self, fields: tuple) -> tuple[list[int] | None, str | None]:
        """The judge's prompt ids for one sample, or why there are none."""
        try:
            prompt = self.prompt_fn(*fields)
        except Exception as err:  # noqa: BLE001 - the user's function: the sample's error
            return None, f"{PROMPT_FN} raised {type(err).__name__}: {err}"[:500]
        if isinstance(prompt, list):
            try:
                text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
            except Exception as err:  # noqa: BLE001 - no template, or messages it cannot render: the sample's error
                return None, f"the judge's chat template cannot render {PROMPT_FN}'s messages: {err}"[:500]
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has its own
        elif isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            return None, f"{PROMPT_FN} returned {type(prompt).__name__}: expected a string or a list of chat messages"
        if not ids or len(ids) > self.max_prompt:
            return None, f"the judge's prompt has {len(ids)} tokens; it takes 1 to {self.max_prompt} (reward.judge)"
        return ids, None

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


def call_score(fn: Callable, verdict: str, fields: tuple) -> tuple[float | None, str | None]:
    """The parser's score of `verdict`, or the error that stands for it."""
    try:
        score = fn(verdict, *fields)
    except Exception as err:  # noqa: BLE001 - the user's parser: the sample's error
        return None, f"{SCORE_FN} raised {type(err).__name__}: {err}"[:500]
    if isinstance(score, bool) or not isinstance(score, int | float) or not math.isfinite(score):
        return None, f"{SCORE_FN} returned {score!r}: expected a finite number"[:500]
    return float(score), None


def judge_functions(path: str, key: str = "reward.judge.path") -> tuple[Callable, Callable]:
    """The user's judge_prompt and judge_score from `path`, or one error naming what is missing."""
    module = load_user_module(path, key)
    missing = [name for name in (PROMPT_FN, SCORE_FN) if not callable(getattr(module, name, None))]
    if missing:
        raise ValueError(f"{key} {path!r} defines no {' and no '.join(missing)}: define both (stages/judge.py)")
    return getattr(module, PROMPT_FN), getattr(module, SCORE_FN)
