"""The embedded default task: a tiny model, its tokenizer and a verifiable data set, built offline in seconds.

The pipeline must run end to end on a 2-core laptop with no network, so `model.path=embedded` and
`data.train_files=embedded` build everything here from a seed:

- Task: reverse a list of distinct letters, `reverse: c a f e =` -> `e f a c`. The verifier
  (stages/verifiers.py) pays 1.0 for an exact answer and partial credit for a correct prefix, so GRPO groups
  have reward variance from the first step. Letters are distinct so that the next answer letter is always
  "the prompt letter just before the one I last wrote": an induction-style lookup that a 2-layer model
  learns in a few hundred supervised steps (with repeated letters it would have to count positions).
- Lengths: the list length follows a truncated geometric law over 1..MAX_LETTERS (40% of lists have 1-3
  letters, 13% have 12 or more), so response lengths have the long tail that makes synchronous RL wait on
  stragglers; answers that derail before EOS run to max_response_length and stretch it further.
- Tokenizer: a byte-level BPE trained on task text. It learns one token per " x" (a letter with its leading
  space), so the answer is the prompt's letter tokens in reverse order; the byte alphabet keeps any text
  encodable. 291 ids.
- Model: a random-init Qwen2 (an architecture both HF and vLLM serve), 2 layers, hidden 128, head_dim 32 (vLLM's
  CPU attention needs 32, 64, 80, ... 128), 0.47M parameters, float32 safetensors, untied embeddings.
  `model.arch=moe` builds a Qwen3-MoE of the same depth and width instead: each layer's MLP is 4 experts of 192 with
  top-2 routing (vLLM's CPU MoE kernel needs the hidden and expert sizes to be multiples of 32), 0.76M parameters.

pipeline/tasks/warmstart.py then trains the format and the circuit, leaving the sampled reward low for RL to raise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "reverse"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_LETTERS = 20
# P(length = k) ~ LENGTH_DECAY ** (k - 1): median 5, mean 5.9, 13% of lists have 12+ letters.
LENGTH_DECAY = 0.85
PROMPT_PREFIX = "reverse:"
PROMPT_SUFFIX = "="
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# The BPE trainer gives special tokens the first ids, in this order; the model config relies on it.
EOS_ID, PAD_ID = 0, 1
TOKENIZER_CORPUS_ROWS = 4000

# Model shape: hidden 128 / 4 heads = head_dim 32 (vLLM CPU attention needs 32, 64, 80, ... 128).
HIDDEN_SIZE = 128
NUM_HEADS = 4
NUM_KV_HEADS = 2
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 384
MAX_POSITIONS = 256
# Wider than HF's 0.02 default (1/sqrt(128) is 0.088). Measured: with 0.02 the warm start sat on its loss
# plateau for 800 steps; with 0.05 the reversal circuit forms in 200-500 steps, i.e. in 10-25 s.
INIT_STD = 0.05
# model.arch=moe: every layer's MLP is a router over NUM_EXPERTS SwiGLU experts, TOP_K of them per token.
NUM_EXPERTS = 4
TOP_K = 2
MOE_INTERMEDIATE_SIZE = 192
ARCHS = ("dense", "moe")


@dataclass(frozen=True)
class EmbeddedTask:
    """Where build_embedded put the model (with its tokenizer), the prompt file and the held-out prompts."""

    model_dir: Path
    data_file: Path
    val_file: Path


def length_weights() -> list[float]:
    """Unnormalised probability of each list length 1..MAX_LETTERS (truncated geometric)."""
    return [LENGTH_DECAY ** (k - 1) for k in range(1, MAX_LETTERS + 1)]


def format_prompt(letters: list[str]) -> str:
    """`reverse: c a f e =`; the answer follows after one space, so ' e' tokens continue the prompt."""
    return " ".join([PROMPT_PREFIX, *letters, PROMPT_SUFFIX])


def make_rows(num: int, seed: int) -> list[dict]:
    """`num` prompts with their ground truth; the same seed always gives the same rows."""
    rng = random.Random(seed)
    lengths = rng.choices(range(1, MAX_LETTERS + 1), weights=length_weights(), k=num)
    rows = []
    for length in lengths:
        letters = rng.sample(LETTERS, length)  # distinct letters: see the module docstring
        rows.append(
            {
                "prompt_text": format_prompt(letters),
                "ground_truth": " ".join(reversed(letters)),
                "data_source": DATA_SOURCE,
            }
        )
    return rows


def build_tokenizer(out_dir: Path, seed: int, corpus: list[str] | None = None):
    """Train a byte-level BPE on task text (`corpus`, default the reversal task's) and save it as a transformers fast
    tokenizer in out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    # Qwen2's exact normalizer and pre-tokenizer: AutoTokenizer (and so vLLM) loads this directory as a
    # Qwen2Tokenizer because config.json says qwen2, and that class rebuilds these; matching them means
    # every loader tokenizes alike. The regex keeps ' c' as one pre-token, so BPE can merge it to one id.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,  # an upper bound: training stops when no pair repeats (~300 ids for this text)
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, nothing maps to <unk>
        show_progress=False,
    )
    if corpus is None:
        corpus = [f"{r['prompt_text']} {r['ground_truth']}" for r in make_rows(TOKENIZER_CORPUS_ROWS, seed)]
        # Every letter in every slot: guarantees the ' x' merge for all 26 letters whatever the seed.
        corpus.append(format_prompt(list(LETTERS)))
    tok.train_from_iterator(corpus, trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == EOS_ID and tok.token_to_id(PAD_TOKEN) == PAD_ID
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, model_max_length=MAX_POSITIONS
    )
    hf_tok.save_pretrained(out_dir)
    return hf_tok


def build_model(out_dir: Path, vocab_size: int, seed: int, arch: str = "dense") -> None:
    """Save a random-init float32 model of the embedded shape to out_dir (safetensors): a Qwen2 ('dense') or a
    Qwen3-MoE ('moe')."""
    import torch
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"model.arch must be one of {ARCHS}, not {arch!r}")
    common = dict(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
    )
    if arch == "moe":
        from transformers import Qwen3MoeConfig as Config
        from transformers import Qwen3MoeForCausalLM as Model

        # norm_topk_prob as in Qwen3-30B-A3B: the chosen experts' weights sum to 1.
        common |= dict(
            head_dim=HIDDEN_SIZE // NUM_HEADS,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
            norm_topk_prob=True,
        )
    else:
        from transformers import Qwen2Config as Config
        from transformers import Qwen2ForCausalLM as Model
    with torch.random.fork_rng():  # seed the init without moving the caller's global RNG
        torch.manual_seed(seed)
        model = Model(Config(**common)).to(torch.float32)
    # Only the ids: sampling defaults here (e.g. top_k) would silently change what vLLM samples.
    model.generation_config = GenerationConfig(eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(out_dir, safe_serialization=True)


def write_rows(rows: list[dict], path: Path) -> None:
    """Write prompt rows as parquet with the prompt columns the source reads (agent_name when the rows have it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = ("prompt_text", "ground_truth", "data_source") + (("agent_name",) if "agent_name" in rows[0] else ())
    pq.write_table(pa.table({key: pa.array([r[key] for r in rows], pa.string()) for key in columns}), path)


def build_embedded(
    run_dir: Path, num_prompts: int, seed: int, num_val_prompts: int = 64, task: str = "reverse", arch: str = "dense"
) -> EmbeddedTask:
    """Build tokenizer + model into run_dir/model, the prompts into run_dir/data/train.parquet and held-out ones
    into run_dir/data/val.parquet. `task`: 'reverse' (this module) or 'calc' (pipeline/tasks/embedded_calc.py);
    `arch`: 'dense' or 'moe' (build_model)."""
    from pipeline.tasks import embedded_calc

    if task not in ("reverse", "calc"):
        raise ValueError(f"data.embedded_task must be 'reverse' or 'calc', not {task!r}")
    rows_of = make_rows if task == "reverse" else embedded_calc.make_rows
    run_dir = Path(run_dir)
    model_dir = run_dir / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    corpus = embedded_calc.corpus(TOKENIZER_CORPUS_ROWS, seed) if task == "calc" else None
    tokenizer = build_tokenizer(model_dir, seed, corpus)
    build_model(model_dir, len(tokenizer), seed, arch)
    data_file = run_dir / "data" / "train.parquet"
    # A different stream from the tokenizer corpus (seed + 1): the data set is not the BPE training text.
    train = rows_of(num_prompts, seed + 1)
    write_rows(train, data_file)
    # Held out: a third stream, without any prompt of the training set (short lists repeat).
    seen = {r["prompt_text"] for r in train}
    val = [r for r in rows_of(4 * num_val_prompts, seed + 2) if r["prompt_text"] not in seen]
    write_rows(list({r["prompt_text"]: r for r in val}.values())[:num_val_prompts], run_dir / "data" / "val.parquet")
    return EmbeddedTask(model_dir=model_dir, data_file=data_file, val_file=run_dir / "data" / "val.parquet")
