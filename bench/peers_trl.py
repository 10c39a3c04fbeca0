"""bench.peers' TRL side: one GRPOTrainer run from a spec file, run with the python of the peers' own virtualenv.

    ~/.cache/asyncrl/peers-venv/bin/python bench/peers_trl.py SPEC.json

The spec (written by bench.peers) names the model directory, a JSONL of prompts in the order to train them
(prompt, ground_truth), the reward ('reverse': stages/verifiers.py's score_reverse, 'letters':
bench/peers_task.py's letters_score), the torch threads, the GRPOConfig keywords, and where to write one JSON line
per optimizer step (`step`, `t` the wall clock at its end, `reward`, `completion_tokens`, `loss`) plus a first line
`{"event": "train_begin", "t": ...}`. It imports nothing of asyncrl's but those two reward functions.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def reward_function(name: str):
    """A TRL reward function (completions and the dataset's columns in, one float per completion out)."""
    sys.path.insert(0, str(ROOT))
    if name == "reverse":
        from stages.verifiers import score_reverse

        def reverse(completions, ground_truth, **kwargs):
            return [score_reverse(c, g) for c, g in zip(completions, ground_truth, strict=True)]

        return reverse
    if name == "letters":
        from bench.peers_task import letters_score

        def letters(completions, **kwargs):
            return [letters_score(c) for c in completions]

        return letters
    raise SystemExit(f"unknown reward {name!r}: expected 'reverse' or 'letters'")


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    out = open(spec["out"], "a", buffering=1)  # noqa: SIM115 - one line per step, flushed as written

    class StepLog(TrainerCallback):
        """One line per optimizer step; TRL logs every step (logging_steps=1)."""

        def on_train_begin(self, args, state, control, **kwargs):
            out.write(json.dumps({"event": "train_begin", "t": time.time()}) + "\n")

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                tokens = logs["completions/mean_length"] * spec["samples_per_step"]
                row = {"step": state.global_step, "t": time.time(), "reward": logs["reward"]}
                out.write(json.dumps(row | {"completion_tokens": tokens, "loss": logs.get("loss")}) + "\n")

    rows = [json.loads(line) for line in Path(spec["prompts"]).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], local_files_only=True, dtype=torch.float32)
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=reward_function(spec["reward"]),
        args=GRPOConfig(output_dir=spec["output_dir"], **spec["config"]),
        train_dataset=Dataset.from_list(rows),
        callbacks=[StepLog()],
    )
    trainer.train()
    out.close()


if __name__ == "__main__":
    main()
