"""Shared by the GPU check and the realistic-shape bench: model directories with the exact widths of the
recipes' models (random init, no download), synthetic data of a chosen length, and model FLOPs.

A model directory here is a Hugging Face ``config.json`` (written by transformers' own config class for
the family) plus the tiny test tokenizer's files (``tests/fixtures/tiny/model``): the tokenizer only ever
emits ids below 448, which is all the data needs, while the embedding and the output layer have the real
vocabulary (128k / 152k / 256k), so every matrix, the log-softmax and the memory are full size.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "tests" / "fixtures" / "tiny" / "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Hugging Face names of the models behind the recipes (dimensions from hl_core.models.specs.MODEL_SPECS)
SHAPES = {
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "gemma2-27b": "google/gemma-2-27b-it",
}

# what the families' public config.json files hold beyond the dimensions (so the model computes the same)
_FAMILY_EXTRAS = {
    "llama": dict(rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu"),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", use_sliding_window=False),
    "gemma2": dict(rms_norm_eps=1e-6, rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh",
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096),
}
# the tiny tokenizer's special ids
_TOKEN_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def spec_of(shape: str, num_layers: Optional[int] = None, **changes):
    """The ``ModelSpec`` of ``shape`` (a key of SHAPES), with the depth cut to ``num_layers`` if given."""
    from hl_core.models.specs import MODEL_SPECS

    spec = MODEL_SPECS[SHAPES[shape]]
    if num_layers is not None:
        changes["num_layers"] = num_layers
    return dataclasses.replace(spec, **changes) if changes else spec


def write_model_dir(spec, out_dir: Path) -> Path:
    """A config-only model directory for ``spec`` (use with ``model.random_init: true``)."""
    from transformers import AutoConfig

    extras = dict(_FAMILY_EXTRAS.get(spec.model_type, _FAMILY_EXTRAS["llama"]))
    if spec.model_type == "gemma2":
        extras["query_pre_attn_scalar"] = spec.hidden_size // spec.num_heads
    config = AutoConfig.for_model(
        spec.model_type, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, vocab_size=spec.vocab_size,
        intermediate_size=spec.intermediate_size, head_dim=spec.kv_channels,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings or 8192, attention_dropout=0.0, **extras, **_TOKEN_IDS,
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).exists():
            shutil.copy(TOKENIZER_DIR / name, out_dir / name)
    return out_dir


_WORDS = ("the garden river morning song city forest house letter meal story voice window road field sky lovely "
          "bright kind calm gentle warm clear sweet happy fresh friendly pleasant dull grim cold harsh bleak sour "
          "rude dark sad stale hostile awful very quite so really describe tell about what like how would you").split()


def _text(rng: random.Random, counts: dict, tokens: int) -> str:
    """Random words, as many as fit in ``tokens`` tokens. ``counts[(word, first)]`` is the word's token
    count (a byte-level BPE tokenizes each space-separated word on its own, so counts add up)."""
    words, used = [], 0
    while True:
        word = rng.choice(_WORDS)
        cost = counts[(word, not words)]
        if used + cost > tokens:
            return " ".join(words)
        words.append(word)
        used += cost


def write_rows(path: Path, kind: str, rows: int, completion_tokens: int, prompt_tokens: int = 24,
               seed: int = 0) -> float:
    """``rows`` JSONL rows of ``kind`` (``pairs``: prompt/chosen/rejected, ``sft``: prompt/completion)
    whose completions are just under ``completion_tokens`` tokens. Returns the mean tokens per sequence
    (prompt + completion, as the trainer sees them before the chat template's few tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    counts = {(w, first): len(tokenizer(w if first else " " + w, add_special_tokens=False)["input_ids"])
              for w in _WORDS for first in (True, False)}
    rng = random.Random(seed)
    lengths = []
    with open(path, "w") as handle:
        for _ in range(rows):
            prompt = _text(rng, counts, prompt_tokens)
            first, second = _text(rng, counts, completion_tokens), _text(rng, counts, completion_tokens)
            row = {"prompt": prompt, "chosen": first, "rejected": second} if kind == "pairs" else {
                "prompt": prompt, "completion": first}
            for completion in (first, second) if kind == "pairs" else (first,):
                lengths.append(len(tokenizer(prompt + " " + completion, add_special_tokens=False)["input_ids"]))
            handle.write(json.dumps(row) + "\n")
    return sum(lengths) / len(lengths)


def write_prompts(path: Path, rows: int, seed: int = 0) -> None:
    """Two-digit addition prompts with answers (the math reward's form)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(rows):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            handle.write(json.dumps({"prompt": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")


def forward_flops_per_token(spec, seq_len: float) -> float:
    """Model FLOPs of one forward pass per token (the PaLM / Megatron convention, Chowdhery et al. 2022,
    appendix B): 2 FLOPs per multiply-add of every weight matrix (attention and MLP projections of every
    layer and the output layer; not the embedding lookup, norms or rotary) plus the attention scores and
    the weighted values, ``4 * layers * (heads * head_dim) * seq_len`` (counted over the full sequence,
    as that convention does, although causal kernels skip about half)."""
    matmul_params = spec.num_layers * (spec.attention_params() + spec.mlp_params()) + spec.vocab_size * spec.hidden_size
    return 2.0 * matmul_params + 4.0 * spec.num_layers * spec.q_dim * seq_len
