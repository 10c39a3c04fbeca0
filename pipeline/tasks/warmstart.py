"""A short supervised warm start of the embedded model, on CPU, before RL.

A random-init model never ends an answer with EOS nor writes the letters in order, so every GRPO group
would score ~0 and carry no gradient. The warm start trains on `prompt + " " + answer + eos` (loss on the
answer and EOS only: the prompt letters are random, predicting them would waste capacity) until the model
has the reversal circuit, i.e. its greedy answer is mostly right. The multi-turn task (pipeline/tasks/embedded_calc.py)
trains on its whole demonstration, tool call, tool result and answer, with no loss on the tool's result.

It does so with label smoothing 0.5, which is what leaves room for RL. Measured with the learnability check
(8 prompts x 8 samples per step, 2 CPU cores):
- stopping plain SFT early, before the circuit forms, gives a low reward that RL cannot raise: building the
  circuit from 64 sampled answers per step takes far more than 150 steps;
- plain SFT past the circuit gives a confident model whose sampled reward is already ~0.9.
With smoothing, half of the probability mass stays spread over the vocabulary, so answers sampled at
temperature 1 derail early (reward 0.10-0.15) while greedy ones score 0.83-0.96. Concentrating the mass on the
right tokens is a direction every sample agrees on, so GRPO lifts the sampled reward to 0.75-0.9 in 150 steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.tasks import embedded_calc

# Measured on an idle 2-core box: 45 ms/step with 2 threads, 71 ms with 1 (500 steps: ~23 s). It runs before
# the stream starts, so it may take both cores.
WARM_START_THREADS = min(2, os.cpu_count() or 1)
WARMUP_FRACTION = 0.1
LABEL_SMOOTHING = 0.5


def demonstration(row: dict) -> list[tuple[str | None, bool]]:
    """The response to train on as (text, trained) pieces, None standing for EOS; by the row's task."""
    if row.get("data_source") == embedded_calc.DATA_SOURCE:
        return embedded_calc.demonstration(row)
    return [(" " + row["ground_truth"], True), (None, True)]


def encode_examples(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int], list[bool]]]:
    """(prompt ids, response ids, which response ids are trained) per row.

    Each piece is tokenized apart, as the pipeline tokenizes prompts and as an agent loop tokenizes the text it
    appends, so the model trains on the token boundaries it will see."""
    examples = []
    for row in rows:
        prompt = tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
        response: list[int] = []
        trained: list[bool] = []
        for text, train in demonstration(row):
            ids = [tokenizer.eos_token_id] if text is None else tokenizer(text, add_special_tokens=False)["input_ids"]
            response += ids
            trained += [train] * len(ids)
        examples.append((prompt, response, trained))
    return examples


def collate(examples: list[tuple[list[int], list[int], list[bool]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt, untrained pieces and padding),
    labels unshifted."""
    width = max(len(p) + len(a) for p, a, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, (prompt, answer, trained) in enumerate(examples):
        n = len(prompt) + len(answer)
        ids[i, :n] = torch.tensor(prompt + answer)
        target = torch.tensor(answer)
        target[~torch.tensor(trained, dtype=torch.bool)] = -100
        labels[i, len(prompt) : n] = target
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lr_factor(step: int, steps: int) -> float:
    """Linear warmup, then constant: a decaying rate slows the phase change in which the circuit forms."""
    warmup = max(1, int(WARMUP_FRACTION * steps))
    return min(1.0, (step + 1) / warmup)


def sft_loss(model, batch: dict[str, torch.Tensor], smoothing: float) -> tuple[torch.Tensor, float]:
    """(label-smoothed loss to train on, plain answer NLL to report) of one batch."""
    labels = batch["labels"][:, 1:].flatten()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].flatten(0, 1)
    loss = torch.nn.functional.cross_entropy(logits, labels, label_smoothing=smoothing)
    with torch.no_grad():
        nll = torch.nn.functional.cross_entropy(logits, labels).item()
    return loss, nll


def warm_start(
    model_dir: Path,
    data_file: Path,
    steps: int,
    lr: float,
    seed: int,
    batch_size: int = 32,
    smoothing: float = LABEL_SMOOTHING,
) -> dict:
    """Fine-tune the model in model_dir on the prompts of data_file, save it back there, return metrics."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(WARM_START_THREADS)
    torch.manual_seed(seed)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
    examples = encode_examples(tokenizer, pq.read_table(data_file).to_pylist())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, steps))
    rng = random.Random(seed)
    model.train()
    nlls: list[float] = []
    for _ in range(steps):
        batch = collate(rng.sample(examples, min(batch_size, len(examples))), tokenizer.pad_token_id)
        loss, nll = sft_loss(model, batch, smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        nlls.append(nll)
    model.save_pretrained(model_dir, safe_serialization=True)
    tail = nlls[-10:] or [float("nan")]  # the last step alone is one noisy batch
    return {
        "steps": steps,
        "first_loss": nlls[0] if nlls else float("nan"),
        "final_loss": sum(tail) / len(tail),
        "seconds": time.perf_counter() - start,
    }


def cached_warm_start(
    model_dir: Path, data_file: Path, steps: int, lr: float, seed: int, smoothing: float, cache: str
) -> dict:
    """`warm_start`, or the model it made before from the same inputs: every run of `make run` and most test runs
    warm-start the same embedded model the same way, tens of seconds each on 2 cores.

    The key hashes everything the result depends on: the model directory's files and the task rows as built, the
    hyper-parameters, this module's and the demonstrations' source, and the torch and transformers versions. An
    entry is written under a temporary name and renamed, so a run that dies mid-write leaves none half-made, and
    two runs that warm-start at once both find a whole one. `cache` '' trains every time. A cache that cannot be
    written costs the saving only: the run goes on with the model it trained."""
    if not cache:
        return warm_start(model_dir, data_file, steps, lr, seed, smoothing=smoothing)
    root = Path(cache).expanduser()
    entry = root / _cache_key(model_dir, data_file, [steps, lr, seed, smoothing])
    if (entry / "stats.json").exists():
        for path in entry.iterdir():
            if path.name != "stats.json":
                shutil.copy2(path, model_dir / path.name)
        return {**json.loads((entry / "stats.json").read_text()), "cached": str(entry)}
    stats = warm_start(model_dir, data_file, steps, lr, seed, smoothing=smoothing)
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root))
        for path in model_dir.iterdir():
            shutil.copy2(path, staging / path.name)
        (staging / "stats.json").write_text(json.dumps(stats))
        try:
            staging.rename(entry)
        except OSError:  # another run wrote the same entry first: theirs is as good
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as err:
        print(f"asyncrl: the warm start is not cached ({err}); set model.warm_start_cache to a writable directory")
    return stats


def _cache_key(model_dir: Path, data_file: Path, params: list) -> str:
    import transformers

    digest = hashlib.sha256(
        json.dumps([params, WARM_START_THREADS, torch.__version__, transformers.__version__]).encode()
    )
    sources = [Path(__file__), Path(embedded_calc.__file__), data_file]
    for path in [*sources, *sorted(p for p in model_dir.iterdir() if p.is_file())]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]
