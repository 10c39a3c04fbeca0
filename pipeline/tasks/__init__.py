"""Prompt data and the embedded tasks: source.py reads and validates prompt files (verl's RL format or flat) and
lays out the admission blocks; embedded.py and embedded_calc.py build the tiny model, tokenizer and tasks that run
on a laptop; warmstart.py is their supervised warm start; gsm8k_synth.py and random_model.py generate a GSM8K-style
set and a 0.45B random Qwen2 offline."""
