"""A tiny discriminative reward model for the embedded reversal task, built and trained here in minutes, offline: what
the reward-model stage (stages/reward_model.py) scores with in tests and demonstrations.

It learns to predict the task's rule score (stages.verifiers.score_reverse: 1 for the exact reversal, else the right
prefix's share) from the prompt and a response: a Qwen2ForSequenceClassification (one label) whose backbone starts from
the warm-started policy (`policy_dir`), as reward models start from a supervised model: that backbone already finds the
letter that should come next, which is what judging an answer needs.

Trained on the last token alone (the score the stage reads), two layers learn slowly: a score at the end has to sum up
a comparison made all along the response. So the score head is trained at every response token, on the rule score of
the response cut there (the last token's target is the whole response's score), a dense target from the same rule.
Measured on 2 shared cores (seed 0, tests/pipeline/test_rewards.py's fixture, 2026-11-25): 800 steps of 32 responses
in 97 s order 0.87 of held-out pairs of answers to one prompt as the rule orders them (mean absolute error 0.14),
against 0.64-0.67 for 400-1500 steps on the last token alone (held_out_fit).

The responses look like the warm-started policy's samples: right answers, right prefixes that derail into other
letters, answers cut short or run on, other letters, and any of these with stray tokens of the vocabulary in them
(sampling at temperature 1 writes those), each token's target computed by the rule on the decoded text.

Its tokenizer is the policy's with a chat template of its own (the policy's has none) that writes the user's prompt and
the assistant's response back to back, as the policy read and wrote them: the text its backbone knows.

    python -m pipeline.tasks.embedded_rm OUT_DIR --init-from runs/<run>/model
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from pipeline.tasks.embedded import EOS_ID, LETTERS, PAD_ID, make_rows
from stages.verifiers import score_reverse

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
THREADS = 1  # two threads, on a busy machine, spend most of their time waiting for each other
Example = tuple[list[int], list[float]]  # input ids (prompt + response), the target of each response token


def letters_for(truth: list[str], rng: random.Random) -> list[str]:
    """The letters of a response of one of the kinds the warm-started policy samples."""
    kind = rng.random()
    others = [c for c in LETTERS if c not in truth] or list(LETTERS)
    if kind < 0.25:
        return truth
    if kind < 0.65:  # a right prefix, then other letters
        keep = rng.randrange(len(truth))
        return truth[:keep] + rng.choices(others + truth, k=rng.randint(1, max(1, len(truth) - keep + 2)))
    if kind < 0.75:  # cut short
        return truth[: rng.randrange(1, len(truth))] if len(truth) > 1 else rng.choices(others, k=1)
    if kind < 0.85:  # runs on
        return truth + rng.choices(LETTERS, k=rng.randint(1, 4))
    return rng.sample(truth, len(truth)) if rng.random() < 0.5 else rng.choices(LETTERS, k=rng.randint(1, 8))


def examples(tokenizer, num: int, seed: int, per_prompt: int = 1) -> list[Example]:
    """`per_prompt` responses to each of `num` prompts, one after the other, with their per-token targets."""
    rng = random.Random(seed)
    letter_id = {c: tokenizer(" " + c, add_special_tokens=False)["input_ids"][0] for c in LETTERS}
    stray = [i for i in range(len(tokenizer)) if i not in (EOS_ID, PAD_ID)]
    out = []
    for row in make_rows(num, seed):
        prompt = tokenizer(row["prompt_text"], add_special_tokens=False)["input_ids"]
        for _ in range(per_prompt):
            response = [letter_id[c] for c in letters_for(row["ground_truth"].split(), rng)]
            if rng.random() < 0.3:
                for _ in range(rng.randint(1, 3)):
                    response.insert(rng.randrange(len(response) + 1), rng.choice(stray))
            targets = [
                score_reverse(tokenizer.decode(response[: j + 1]), row["ground_truth"]) for j in range(len(response))
            ]
            out.append((prompt + response, targets))
    return out


def collate(batch: list[Example]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask, per-token targets and the mask of the tokens that have one."""
    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), PAD_ID, dtype=torch.long)
    attention = torch.zeros_like(ids)
    targets = torch.zeros((len(batch), width))
    scored = torch.zeros((len(batch), width))
    for i, (row, target) in enumerate(batch):
        n, r = len(row), len(target)
        ids[i, :n], attention[i, :n] = torch.tensor(row), 1
        targets[i, n - r : n], scored[i, n - r : n] = torch.tensor(target), 1.0
    return ids, attention, targets, scored


def build_reward_model(
    out_dir: Path, policy_dir: Path, steps: int = 800, seed: int = 0, lr: float = 1e-3, threads: int = THREADS
) -> dict:
    """Train the reward model from `policy_dir`'s backbone and tokenizer, save it (with its tokenizer) to out_dir;
    returns the held-out fit (held_out_fit) and the time it took. `threads`: torch's, more where the fit has the
    machine to itself."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    config = AutoConfig.from_pretrained(policy_dir, local_files_only=True, num_labels=1, pad_token_id=PAD_ID)
    model = AutoModelForSequenceClassification.from_pretrained(
        policy_dir, config=config, local_files_only=True, dtype=torch.float32
    )
    batch_size = 32
    train = examples(tokenizer, steps * batch_size, seed + 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for step in range(steps):
        ids, attention, targets, scored = collate(train[step * batch_size : (step + 1) * batch_size])
        hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
        per_token = model.score(hidden)[..., 0]  # (B, T): the head at every token; the stage reads the last
        loss = ((per_token - targets) ** 2 * scored).sum() / scored.sum()
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
    return {"steps": steps, "final_loss": sum(tail) / len(tail), **fit, "seconds": time.perf_counter() - start}


@torch.no_grad()
def held_out_fit(model, tokenizer, seed: int, num: int = 128) -> dict:
    """On `num` unseen prompts with two responses each, the model's score where the stage reads it (the last token):
    the mean absolute error against the rule score, and the share of the pairs the rule tells apart that the model
    orders as the rule does (what a group-relative estimator uses of a reward)."""
    held = examples(tokenizer, num, seed, per_prompt=2)
    predicted: list[float] = []
    for i in range(0, len(held), 32):
        ids, attention, _, _ = collate(held[i : i + 32])
        predicted += model(input_ids=ids, attention_mask=attention).logits[:, -1].tolist()
    truth = [target[-1] for _, target in held]
    errors = [abs(p - t) for p, t in zip(predicted, truth, strict=True)]
    pairs = [(i, i + 1) for i in range(0, len(held), 2) if truth[i] != truth[i + 1]]
    agree = sum((predicted[i] > predicted[j]) == (truth[i] > truth[j]) for i, j in pairs)
    return {"mae": sum(errors) / len(errors), "pair_agreement": agree / max(len(pairs), 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--init-from", type=Path, required=True, help="a warm-started embedded policy directory")
    parser.add_argument("--steps", type=int, default=800)
    args = parser.parse_args(argv)
    print(build_reward_model(args.out_dir, args.init_from, args.steps))


if __name__ == "__main__":
    main()
