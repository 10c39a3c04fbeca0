"""A small GSM8K-style data set, generated from templates in verl's RL format (nothing is downloaded).

Grade-school word problems with integer answers from six templates (shopping totals, change from a bill, sharing
equally, rate times time, pages per day, more-than comparisons), numbers drawn from a seed. Rows have the
schema verl's `examples/data_preprocess/gsm8k.py` writes, so the same file feeds verl or this pipeline:

    data_source   "openai/gsm8k"
    prompt        [{"role": "user", "content": question + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<int>"}
    extra_info    {"split", "index", "question", "answer"} as verl's, plus "template" and "numbers"
                  (the drawn numbers, in the template's order, so a test can recompute every answer)

`extra_info.answer` is a worked solution ending in `#### <int>`, as GSM8K's. Questions are kept short (under ~120
characters) so that prompts fit the embedded model's 256 positions even though its tokenizer, trained on letter
lists, spends about one token per character of English. Train and test questions are distinct.

Regenerate the committed files with:

    python -m pipeline.tasks.gsm8k_synth --out data/gsm8k_synth --train 200 --test 50 --seed 0
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
# verl's gsm8k preprocessing appends exactly this to every question.
INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
NAMES = ("Mia", "Ben", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Amy")
ITEMS = ("pens", "apples", "books", "cups", "toys", "cards")


@dataclass(frozen=True)
class Problem:
    """One drawn problem: the numbers in the template's order, the question, a worked solution, the answer."""

    numbers: list[int]
    question: str
    solution: str
    answer: int


def shopping(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(3, 20)
    cost, total = count * price, count * price + extra
    question = f"{name} buys {count} {item} at ${price} each and a bag for ${extra}. How much does {name} spend?"
    return Problem([count, price, extra], question, f"{count} * {price} = {cost}. {cost} + {extra} = {total}.", total)


def change(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count, price = rng.randint(2, 6), rng.randint(2, 9)
    bill = rng.choice([bill for bill in (20, 50, 100) if bill > count * price])
    cost = count * price
    question = f"{name} pays ${bill} for {count} {item} at ${price} each. How much change does {name} get?"
    return Problem(
        [bill, count, price], question, f"{count} * {price} = {cost}. {bill} - {cost} = {bill - cost}.", bill - cost
    )


def sharing(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each = rng.randint(2, 8), rng.randint(2, 12)
    total = friends * each
    question = f"{name} shares {total} {item} equally among {friends} friends. How many does each friend get?"
    return Problem([total, friends], question, f"{total} / {friends} = {each}.", each)


def rate_time(rng: random.Random) -> Problem:
    speed, hours = rng.randint(3, 60), rng.randint(2, 9)
    vehicle = rng.choice(("bus", "bike", "boat", "train"))
    question = f"A {vehicle} goes {speed} miles per hour for {hours} hours. How many miles does it go?"
    return Problem([speed, hours], question, f"{speed} * {hours} = {speed * hours}.", speed * hours)


def reading(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    per_day, days = rng.randint(5, 30), rng.randint(2, 12)
    pages = per_day * days
    question = f"{name} reads {per_day} pages a day. How many days does {name} need for a {pages}-page book?"
    return Problem([per_day, pages], question, f"{pages} / {per_day} = {days}.", days)


def more_than(rng: random.Random) -> Problem:
    first, second = rng.sample(NAMES, 2)
    has, more = rng.randint(3, 40), rng.randint(2, 25)
    other = has + more
    question = f"{first} has {has} marbles. {second} has {more} more than {first}. How many do they have in all?"
    return Problem([has, more], question, f"{has} + {more} = {other}. {has} + {other} = {has + other}.", has + other)


TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    f.__name__: f for f in (shopping, change, sharing, rate_time, reading, more_than)
}


def make_problems(num: int, seed: int) -> list[tuple[str, Problem]]:
    """`num` distinct (template name, problem) pairs; the same seed gives the same problems."""
    rng, seen, problems = random.Random(seed), set(), []
    for _ in range(100 * num):  # bounded: the templates hold tens of thousands of distinct questions
        if len(problems) == num:
            break
        name = rng.choice(sorted(TEMPLATES))
        problem = TEMPLATES[name](rng)
        if problem.question not in seen:  # a repeat would leak between train and test
            seen.add(problem.question)
            problems.append((name, problem))
    if len(problems) < num:
        raise ValueError(f"the templates gave only {len(problems)} distinct problems; ask for fewer than {num}")
    return problems


def verl_row(template: str, problem: Problem, split: str, index: int) -> dict:
    """One row in verl's RL format (see the module docstring)."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": problem.question + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "question": problem.question,
            "answer": f"{problem.solution}\n#### {problem.answer}",
            "template": template,
            "numbers": problem.numbers,
        },
    }


def make_splits(num_train: int, num_test: int, seed: int) -> dict[str, list[dict]]:
    """Rows of the train and test splits, drawn from one stream of distinct problems."""
    problems = make_problems(num_train + num_test, seed)
    return {
        "train": [verl_row(*p, "train", i) for i, p in enumerate(problems[:num_train])],
        "test": [verl_row(*p, "test", i) for i, p in enumerate(problems[num_train:])],
    }


def write_splits(out_dir: Path, num_train: int, num_test: int, seed: int) -> dict[str, Path]:
    """Write <out_dir>/train.parquet and test.parquet; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in make_splits(num_train, num_test, seed).items():
        paths[split] = out_dir / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic GSM8K-style data set in verl's format.")
    parser.add_argument("--out", default="data/gsm8k_synth", help="output directory")
    parser.add_argument("--train", type=int, default=200, help="rows of train.parquet")
    parser.add_argument("--test", type=int, default=50, help="rows of test.parquet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for split, path in write_splits(Path(args.out), args.train, args.test, args.seed).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
