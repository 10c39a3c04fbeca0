"""Build a ~0.45B random-init Qwen2 and the embedded task's prompts for the GPU presets (conf/gpu/), offline.

`python -m pipeline.tasks.random_model OUT_DIR` writes OUT_DIR/model (config.json, model.safetensors and the embedded
task's tokenizer) and OUT_DIR/data/{train,val}.parquet. The shape is Qwen2-like and sized for a GPU smoke run:
24 layers, hidden 1280, 16 heads of 80 (vLLM's attention takes 80), 4 kv heads (so TP 1, 2 or 4 split whole query
groups), SwiGLU 3840, qkv bias, untied embeddings over the task's ~300-token vocabulary: 0.45B parameters, float32.
Any HF Llama/Qwen2 directory works the same way through `model.path`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

SHAPE = {
    "hidden_size": 1280,
    "intermediate_size": 3840,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
}


def build(out_dir: Path, seed: int = 0, num_prompts: int = 20000, shape: dict | None = None) -> Path:
    """Write the model and the prompts under out_dir; returns the model directory."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from pipeline.tasks.embedded import EOS_ID, PAD_ID, build_tokenizer, make_rows, write_rows

    model_dir = Path(out_dir) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(model_dir, seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        **(shape or SHAPE),
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(model_dir, safe_serialization=True)
    write_rows(make_rows(num_prompts, seed + 1), Path(out_dir) / "data" / "train.parquet")
    write_rows(make_rows(256, seed + 2), Path(out_dir) / "data" / "val.parquet")
    return model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.out_dir, args.seed))


if __name__ == "__main__":
    main()
