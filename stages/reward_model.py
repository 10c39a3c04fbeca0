"""RewardModel: score every response with a discriminative reward model (an HF sequence-classification model), in
micro-batches, on a GPU when the actor has one.

Input columns:  sample_id, prompt_text, response_text (reward_sources when present)
Output columns: input columns + reward_sources with a 'reward_model' record for every sample (stages/reward_sources.py)

What the model reads is verl's: the prompt as a user message and the response as the assistant's, rendered with the
reward model's own tokenizer and chat template (which may differ from the policy's), tokenized without adding special
tokens (the template has its own). A tokenizer without a chat template reads the prompt and the response as the
policy saw and wrote them, one after the other. The score is the last logit of the model's output at the last token
(verl reads the same value from vLLM's classify endpoint with the activation off).

An input longer than `max_length` tokens (default: the model's positions) is that sample's error: cutting it would
score another answer. A forward pass that raises (out of memory, say) fails its micro-batch's samples with the
reason; they are scored again, alone, up to `max_attempts` calls in all (reward.on_error=retry). Each sample's
latency_s is its micro-batch's forward pass (its attempts' together).

The model runs in eval mode under torch.inference_mode, in `dtype`, on cuda:0 when the actor was given a GPU (else on
`num_threads` CPU threads).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from schemas import require_columns
from stages.reward_sources import record, records_of, with_records

_NEEDS = ["sample_id", "prompt_text", "response_text"]


class RewardModel:
    def __init__(
        self,
        model_path: str,
        micro_batch_size: int = 8,
        max_length: int | None = None,
        dtype: str = "float32",
        max_attempts: int = 1,
        num_threads: int = 1,
    ) -> None:
        """`num_threads`: torch's threads on a CPU, where the stage shares a few cores with the engines and the
        trainer."""
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        problem = check_model_dir(model_path)
        if problem:
            raise ValueError(problem)
        if micro_batch_size < 1 or max_attempts < 1:
            raise ValueError(f"RewardModel needs micro_batch_size and max_attempts >= 1, got {micro_batch_size}")
        self.device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, local_files_only=True, dtype=getattr(torch, dtype)
        ).to(self.device)
        self.model.eval()
        positions = getattr(self.model.config, "max_position_embeddings", None)
        self.max_length = max_length or positions or 1 << 30
        self.micro_batch_size, self.max_attempts = micro_batch_size, max_attempts
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.model.config.pad_token_id
        if self.pad_id is None:  # the model finds each row's last token by its padding: it needs to know the pad
            self.pad_id = self.model.config.pad_token_id = self.tokenizer.eos_token_id

    def __call__(self, batch: pa.Table) -> pa.Table:
        require_columns(batch, _NEEDS, "RewardModel")
        records = records_of(batch)
        ids: list[list[int] | None] = []
        for i, row in enumerate(batch.select(_NEEDS).to_pylist()):
            tokens, error = self.encode(row["prompt_text"], row["response_text"])
            ids.append(tokens)
            if error:
                records[i]["reward_model"] = record(None, error, 0.0)
        todo = [i for i, tokens in enumerate(ids) if tokens is not None]
        for start in range(0, len(todo), self.micro_batch_size):
            self._score([todo[start : start + self.micro_batch_size]], ids, records)
        return with_records(batch, records)

    def encode(self, prompt: str, response: str) -> tuple[list[int] | None, str | None]:
        """The model's input ids for one sample, or why it has none."""
        if getattr(self.tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            text = self.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
        else:
            text = prompt + response
        tokens = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) > self.max_length:
            return None, f"{len(tokens)} tokens, more than the reward model takes ({self.max_length}: max_length)"
        if not tokens:
            return None, "nothing to score: the rendered prompt and response have no tokens"
        return tokens, None

    def _score(self, micro: list[list[int]], ids: list, records: list, attempt: int = 1, spent: float = 0) -> None:
        """Score each micro-batch of row indices in `micro`; one that fails is retried sample by sample."""
        for rows in micro:
            t0 = time.monotonic()
            try:
                scores = self._forward([ids[i] for i in rows])
                error = None
            except Exception as err:  # noqa: BLE001 - the samples' failure, recorded; the run goes on
                scores, error = [None] * len(rows), f"forward pass failed: {type(err).__name__}: {err}"[:500]
            took = time.monotonic() - t0 + spent
            for i, score in zip(rows, scores, strict=True):
                records[i]["reward_model"] = record(score, error, took, attempt)
            if error and attempt < self.max_attempts:
                for i in rows:
                    self._score([[i]], ids, records, attempt + 1, took)

    def _forward(self, rows: list[list[int]]) -> list[float]:
        import torch

        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, tokens in enumerate(rows):
            input_ids[j, : len(tokens)] = torch.tensor(tokens)
            mask[j, : len(tokens)] = 1
        with torch.inference_mode():
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, -1].float().cpu().tolist()


def check_model_dir(path: str) -> str | None:
    """None if `path` looks like an HF sequence-classification model with a tokenizer, else why not (the key and the
    fix). Read from its files only, in milliseconds."""
    where = f"reward.reward_model.model_path {path!r}"
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        return f"{where} has no config.json: point it at an HF model directory (a sequence-classification model)"
    try:
        config: dict[str, Any] = json.loads((directory / "config.json").read_text())
    except ValueError as err:
        return f"{where}: config.json is not JSON ({err})"
    architectures = config.get("architectures") or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        return (
            f"{where} holds a {architectures[0]}, not a sequence-classification model (its architectures should "
            "end in ForSequenceClassification, as a reward model's do)"
        )
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return f"{where} has no tokenizer: save the reward model's tokenizer in the same directory"
    return None
