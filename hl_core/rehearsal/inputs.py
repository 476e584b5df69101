"""What a rehearsal runs on instead of the recipe's downloads and outputs, as ``key=value`` overrides of the
recipe itself (so every other key keeps the recipe's value):

* the model: random weights at the recipe's exact widths (``model.random_init``). A model that is not a local
  directory gets a ``config.json`` written from its dimensions in ``hl_core/models/specs.py`` (widths, heads,
  KV heads, vocabulary, tying, biases; constants that shape no tensor, such as the rotary base or Gemma 2's
  soft-capping values, are transformers' defaults), and ``model.config_overrides`` applies on top (e.g.
  ``{num_hidden_layers: 2}``). Nothing is downloaded.
* the tokenizer: the recipe's when it is local, else a word-level one (one token per word).
* the data: the recipe's when its training file is local, else synthetic rows whose every sequence is exactly
  ``data.max_length`` tokens (prompt ``data.max_prompt_length``); with rollouts, prompts, and a sampler that
  returns completions of the full length (``rollout.max_new_tokens``, up to ``data.max_length``) at once.
  Generation itself (its KV cache, vLLM) is not rehearsed; a reward model is replaced by the math reward
  (its memory is not rehearsed either).
* outputs: ``output_dir`` is a temporary directory, removed at the end; no checkpoint, ``final/``,
  evaluation or post-training evaluation; no resume from the recipe's own ``output_dir``.
* the schedule: the reference sync falls on the measured update (``humanline.sync_offset``), and at most
  ``micro_batches`` micro-batches per update (``train.global_batch_size``): per-update time and traffic are
  scaled back to the recipe's gradient accumulation, memory does not depend on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..config import RunShape
from ..models.loading import TOKENIZER_FILES
from ..models.specs import ModelSpec, resolve_spec

ROWS = 64  # synthetic rows (the data order wraps around them)
WORD_VOCAB = 60  # words of the synthetic tokenizer, besides its four special tokens
MEASURED_UPDATE = 1  # updates: 0 warms up (optimizer states, first traces), 1 is measured, 2 is timed
# On a CPU (shape-only kernels) a rehearsal runs at most this many micro-batches per update by default (at least the
# pipeline's stages, so as many are in flight as in the recipe's schedule): memory does not depend on the count,
# time and traffic per update are scaled back to the recipe's accumulation. `--rehearse-micro-batches all`: every one.
DEFAULT_CPU_MICRO_BATCHES = 4


def micro_batch_cap(requested, on_cpu: bool, pp: int = 1) -> Optional[int]:
    """The most micro-batches per update a rehearsal runs (None: the recipe's own count). ``requested``: the
    command line's ``--rehearse-micro-batches`` (a number, ``"all"``, or None for the default)."""
    if requested == "all":
        return None
    if requested is not None:
        return int(requested)
    return max(DEFAULT_CPU_MICRO_BATCHES, pp) if on_cpu else None


def _local_dir(name: Optional[str]) -> Optional[Path]:
    path = Path(name).expanduser() if name else None
    return path if path is not None and path.is_dir() else None


def write_model_config(spec: ModelSpec, directory: Path) -> None:
    """A Hugging Face ``config.json`` with ``spec``'s dimensions."""
    # transformers loads in seconds: only a rehearsal needs it here
    from transformers import AutoConfig

    fields = dict(
        hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, vocab_size=spec.vocab_size, intermediate_size=spec.intermediate_size,
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if spec.head_dim is not None:
        fields["head_dim"] = spec.head_dim
    if spec.max_position_embeddings:
        fields["max_position_embeddings"] = spec.max_position_embeddings
    if spec.model_type == "llama":
        fields.update(attention_bias=spec.o_bias, mlp_bias=spec.mlp_bias)
    if spec.model_type == "gemma2":
        fields["query_pre_attn_scalar"] = spec.kv_channels  # Gemma-2-27B's attention scale (head_dim for 2B/9B)
    directory.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(spec.model_type, **fields).save_pretrained(directory)


def write_word_tokenizer(directory: Path) -> None:
    """A word-level tokenizer: ``<pad> <s> </s> <unk>`` then ``w0 .. w59``, one token per whitespace-separated word."""
    # tokenizers / transformers: only a rehearsal builds a tokenizer from scratch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast  # (as above)

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(WORD_VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                        unk_token="<unk>")
    tokenizer.save_pretrained(directory)


def _words(count: int, offset: int) -> str:
    return " ".join(f"w{(offset + i) % WORD_VOCAB}" for i in range(max(count, 1)))


def write_rows(path: Path, prompt_words: int, completion_words: int) -> None:
    """Rows every loader reads: a pair (``chosen`` / ``rejected``, different words), an SFT ``completion`` and
    a reference ``answer`` for rollouts with a verifiable reward."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for row in range(ROWS):
            chosen, rejected = _words(completion_words, row), _words(completion_words, row + 1)
            handle.write(json.dumps({"prompt": _words(prompt_words, 7 * row), "chosen": chosen, "rejected": rejected,
                                     "completion": chosen, "answer": "1"}) + "\n")


class SyntheticSampler:
    """Stands in for generation in a rehearsal: every completion is ``rollout.max_new_tokens`` tokens (fewer when
    the prompt leaves less room in ``data.max_length``) of one word, returned at once."""

    name = "synthetic"

    def __init__(self, token_id: int, max_new_tokens: int, max_length: int):
        self.token_id, self.max_new_tokens, self.max_length = token_id, max_new_tokens, max_length

    def sample_groups(self, prompts, num: int, seeds, greedy: bool = False):
        return [[[self.token_id] * max(1, min(self.max_new_tokens, self.max_length - len(p))) for _ in range(num)]
                for p in prompts]

    def push_weights(self) -> None:
        """Nothing to push: no generation engine."""


def rehearsal_overrides(shape: RunShape, workdir: Path, world_size: int, micro_batches: Optional[int],
                        updates: int) -> Tuple[List[str], List[str], Dict[str, int]]:
    """``(overrides, notes, layout)``: what turns the recipe of ``shape`` into its rehearsal (module docstring), the
    lines that say what changed, and the recipe's own batch layout (``dp``, ``accumulation``) for scaling."""
    model, data, rollout = shape.model, shape.data, shape.rollout
    overrides = [f"output_dir={workdir / 'run'}", "checkpoint.save_every=null", "checkpoint.save_final=false",
                 "checkpoint.resume=never", "eval.every=null", "eval.after_training=false", "data.eval=null",
                 "logging.progress_bar=false", "logging.tensorboard=false", "logging.wandb.enabled=false",
                 "model.random_init=true"]
    notes = []
    spec = resolve_spec(model)
    if _local_dir(model.name_or_path) is None:
        write_model_config(spec, workdir / "model")
        overrides.append(f"model.name_or_path={workdir / 'model'}")
        notes.append(f"model: `{model.name_or_path}` from its dimensions in hl_core/models/specs.py, random weights")
    tokenizer_dir = _local_dir(model.tokenizer or model.name_or_path)
    own_tokenizer = tokenizer_dir is None or not any((tokenizer_dir / f).is_file() for f in TOKENIZER_FILES)
    if own_tokenizer:
        write_word_tokenizer(workdir / "tokenizer")
        overrides.append(f"model.tokenizer={workdir / 'tokenizer'}")
    train_path = data.train.path
    if not (train_path and Path(train_path).is_file()):
        sampled = rollout.every is not None
        prompt = data.max_prompt_length
        completion = data.max_length - prompt - 1  # + EOS: the sequence is exactly data.max_length tokens
        if not own_tokenizer:  # tokens per word unknown: long enough for the truncation rule to cut to size
            prompt, completion = 2 * prompt, 2 * data.max_length
        write_rows(workdir / "data" / "train.jsonl", prompt, completion)
        overrides += [f"data.train.path={workdir / 'data' / 'train.jsonl'}", "data.train.name=null"]
        notes.append(f"data: synthetic rows of {data.max_length} tokens (prompt {data.max_prompt_length})"
                     + ("; rollouts sample full-length completions at once (generation not rehearsed)" if sampled
                        else ""))
    if rollout.every is not None:
        overrides.append("rollout.backend=hf")
        if rollout.every > updates:
            overrides.append(f"rollout.every={updates}")
            notes.append(f"rollout.every {rollout.every} -> {updates}: one sampling for the rehearsed updates")
        if rollout.reward.kind == "reward_model":
            overrides.append("rollout.reward.kind=math")
            notes.append("reward: the math reward instead of the reward model (its memory is not rehearsed)")
    if shape.sync_every is not None:
        overrides.append(f"humanline.sync_offset={MEASURED_UPDATE % shape.sync_every}")
    dp, accumulation = shape.batch_layout(world_size)
    if micro_batches is not None and accumulation > micro_batches:
        overrides += [f"train.global_batch_size={shape.train.micro_batch_size * dp * micro_batches}",
                      "train.gradient_accumulation_steps=null"]
        notes.append(f"gradient accumulation {accumulation} -> {micro_batches} micro-batches per update "
                     "(time and traffic per update scaled back to the recipe's; memory does not depend on it; "
                     f"`--rehearse-micro-batches all` runs all {accumulation})")
    return overrides, notes, {"dp": dp, "accumulation": accumulation}
