"""A tiny discriminative reward model for the embedded reversal task, built and trained here in seconds, offline: what
the reward-model stage (stages/reward_model.py) scores with in tests and demonstrations.

It learns to predict the task's rule score (stages.verifiers.score_reverse: 1 for the exact reversal, else the right
prefix's share) from the prompt and a response, as a regression on the last token's logit
(Qwen2ForSequenceClassification, num_labels 1, mean squared error). Its backbone starts from the warm-started policy
(`init_from`), as reward models start from a supervised model: that backbone already finds the letter that should come
next, which is what judging an answer needs. The responses it trains on look like the warm-started policy's samples:
right answers, right prefixes that derail into other letters, answers cut short or run on, lists of other letters.

Its tokenizer is the policy's plus a chat template of its own (the policy's has none), so the stage renders the
prompt and the response through the reward model's template, as verl does: `user: <prompt>` then
`assistant: <response>`.

    python -m pipeline.tasks.embedded_rm OUT_DIR --init-from runs/<run>/model
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from pipeline.tasks.embedded import LETTERS, PAD_ID, make_rows
from stages.verifiers import score_reverse

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
THREADS = 2


def response_for(truth: list[str], rng: random.Random) -> str:
    """A response of one of the kinds the warm-started policy samples, with the leading space it writes."""
    kind = rng.random()
    others = [c for c in LETTERS if c not in truth] or list(LETTERS)
    if kind < 0.25:
        letters = truth
    elif kind < 0.65:  # a right prefix, then other letters
        keep = rng.randrange(len(truth))
        letters = truth[:keep] + rng.choices(others + truth, k=rng.randint(1, max(1, len(truth) - keep + 2)))
    elif kind < 0.75:  # cut short
        letters = truth[: rng.randrange(1, len(truth))] if len(truth) > 1 else []
    elif kind < 0.85:  # runs on
        letters = truth + rng.choices(LETTERS, k=rng.randint(1, 4))
    else:
        letters = rng.sample(truth, len(truth)) if rng.random() < 0.5 else rng.choices(LETTERS, k=rng.randint(1, 8))
    return " " + " ".join(letters)


def examples(num: int, seed: int, per_prompt: int = 1) -> list[tuple[list[dict], float]]:
    """(chat messages, rule score) pairs: `per_prompt` responses to each of `num` prompts, one after the other."""
    rng = random.Random(seed)
    out = []
    for row in make_rows(num, seed):
        for _ in range(per_prompt):
            response = response_for(row["ground_truth"].split(), rng)
            chat = [{"role": "user", "content": row["prompt_text"]}, {"role": "assistant", "content": response}]
            out.append((chat, score_reverse(response, row["ground_truth"])))
    return out


def encode(tokenizer, batch: list[tuple[list[dict], float]]) -> dict[str, torch.Tensor]:
    texts = [tokenizer.apply_chat_template(chat, tokenize=False) for chat, _ in batch]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    return {**enc, "labels": torch.tensor([score for _, score in batch], dtype=torch.float32)}


def build_reward_model(
    out_dir: Path,
    policy_dir: Path,
    steps: int = 400,
    seed: int = 0,
    lr: float = 1e-3,
    batch_size: int = 32,
) -> dict:
    """Train the reward model from `policy_dir`'s backbone and tokenizer, save it (with its tokenizer) to out_dir;
    returns the held-out fit: mean absolute error, and how often it ranks two answers to one prompt as the rule does."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(THREADS)
    torch.manual_seed(seed)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = AutoConfig.from_pretrained(policy_dir, local_files_only=True, num_labels=1, pad_token_id=PAD_ID)
    model = AutoModelForSequenceClassification.from_pretrained(
        policy_dir, config=config, local_files_only=True, dtype=torch.float32
    )
    train = examples(steps * batch_size, seed + 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        batch = encode(tokenizer, train[step * batch_size : (step + 1) * batch_size])
        labels = batch.pop("labels")
        pred = model(**batch).logits[:, -1]
        loss = torch.nn.functional.mse_loss(pred, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    tail = losses[-20:]
    fit = held_out_fit(model, tokenizer, seed + 20)
    return {"steps": steps, "final_mse": sum(tail) / len(tail), **fit, "seconds": time.perf_counter() - start}


@torch.no_grad()
def held_out_fit(model, tokenizer, seed: int, num: int = 128) -> dict:
    """On `num` unseen prompts with two responses each: the mean absolute error against the rule score, and the share
    of the pairs the rule tells apart that the model orders as the rule does (what GRPO uses of a reward)."""
    batch = examples(num, seed, per_prompt=2)
    predicted: list[float] = []
    for i in range(0, len(batch), 32):
        enc = encode(tokenizer, batch[i : i + 32])
        enc.pop("labels")
        predicted += model(**enc).logits[:, -1].tolist()
    truth = [score for _, score in batch]
    errors = [abs(p - t) for p, t in zip(predicted, truth, strict=True)]
    pairs = [(i, i + 1) for i in range(0, len(batch), 2) if truth[i] != truth[i + 1]]
    agree = sum((predicted[i] > predicted[j]) == (truth[i] > truth[j]) for i, j in pairs)
    return {"mae": sum(errors) / len(errors), "pair_agreement": agree / max(len(pairs), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--init-from", type=Path, required=True, help="a warm-started embedded policy directory")
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    print(build_reward_model(args.out_dir, args.init_from, args.steps))


if __name__ == "__main__":
    main()
