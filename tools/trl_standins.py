"""Local stand-ins for the Hub models, tokenizers and data sets that TRL's trainer tests load.

TRL's DPO, KTO and GRPO trainer tests (``tests/trl_upstream/vendored``) load tiny models from the Hub organisation
``trl-internal-testing`` and the ``zen`` data set in several configurations. TRL makes those with its own scripts
(``scripts/generate_tiny_models``: a real model's config shrunk to a hidden size of 8 or 16 and 2 layers, bf16,
``init_weights_tiny_model``; ``scripts/generate_zen_dataset.py``: the Zen of Python split into prompts and
completions, ``train_test_split(test_size=0.1, shuffle=False)``). This script builds the same kinds of objects here,
with no network:

* a byte-level BPE tokenizer trained on the zen texts, with Qwen's special tokens (``<|endoftext|>`` pad and BOS id,
  ``<|im_end|>`` EOS, no BOS added) or Llama 3's (``<|begin_of_text|>`` added, ``<|eot_id|>`` EOS), and the chat
  templates shipped inside the installed trl (``trl/chat_templates/*.jinja``);
* the tiny models, seeded, saved as a Hugging Face cache laid out as the Hub's
  (``hub/models--ORG--NAME/snapshots/REV`` and ``refs/main``), which ``HF_HUB_OFFLINE=1`` resolves by model id;
* the zen configurations, saved with ``DatasetDict.save_to_disk`` under ``datasets/zen/CONFIG``
  (``tests/trl_upstream/conftest.py`` redirects ``load_dataset("trl-internal-testing/zen", CONFIG, ...)`` there).

Usage: ``python3 tools/trl_standins.py --out DIR`` (about 10 s; the same files, byte for byte, on every run:
``--check`` rebuilds into a temporary folder and compares). Nothing here is committed; the harness builds it on
first use into ``$HL_TRL_STANDINS`` (default ``/tmp/hl-trl-standins``).
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import io
import json
import shutil
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import Callable, Dict, List

ORG = "trl-internal-testing"
STANDINS_VERSION = "1"  # bump when what is built changes: a cache built by another version is rebuilt
DEFAULT_DIR = "/tmp/hl-trl-standins"
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"]
VOCAB = 1024


def zen_lines() -> List[str]:
    """The 19 aphorisms of the Zen of Python (the ``this`` module prints them when imported; kept quiet here)."""
    with redirect_stdout(io.StringIO()):
        import this
    text = codecs.decode(this.s, "rot13")
    return [line for line in text.splitlines()[1:] if line.strip()]


def zen_rows() -> List[Dict[str, object]]:
    """One row per aphorism: a prompt (its first half), the true completion, a wrong one, and a label."""
    lines = zen_lines()
    rows = []
    for i, line in enumerate(lines):
        words = line.split()
        cut = max(1, len(words) // 2)
        other = lines[(i + 7) % len(lines)].split()
        rows.append({
            "prompt": " ".join(words[:cut]),
            "chosen": " " + " ".join(words[cut:]),
            "rejected": " " + " ".join(other[len(other) // 2:]),
            "label": i % 3 != 1,  # a fixed mix of desirable and undesirable rows, as upstream's
        })
    return rows


def _user(text):
    return [{"role": "user", "content": text}]


def _assistant(text):
    return [{"role": "assistant", "content": text.strip()}]


def zen_configs() -> Dict[str, Dict[str, list]]:
    """Every zen configuration the three test files load, column -> values (upstream's column names)."""
    rows = zen_rows()

    def col(name):
        return [r[name] for r in rows]

    unpaired = [(r["chosen"] if r["label"] else r["rejected"]) for r in rows]
    return {
        "standard_language_modeling": {"text": [r["prompt"] + r["chosen"] for r in rows]},
        "standard_prompt_only": {"prompt": col("prompt")},
        "standard_prompt_completion": {"prompt": col("prompt"), "completion": col("chosen")},
        "standard_preference": {"prompt": col("prompt"), "chosen": col("chosen"), "rejected": col("rejected")},
        "standard_implicit_prompt_preference": {"chosen": [r["prompt"] + r["chosen"] for r in rows],
                                                "rejected": [r["prompt"] + r["rejected"] for r in rows]},
        "standard_unpaired_preference": {"prompt": col("prompt"), "completion": unpaired, "label": col("label")},
        "conversational_language_modeling": {"messages": [_user(r["prompt"]) + _assistant(r["chosen"])
                                                          for r in rows]},
        "conversational_prompt_only": {"prompt": [_user(r["prompt"]) for r in rows]},
        "conversational_prompt_completion": {"prompt": [_user(r["prompt"]) for r in rows],
                                             "completion": [_assistant(r["chosen"]) for r in rows]},
        "conversational_preference": {"prompt": [_user(r["prompt"]) for r in rows],
                                      "chosen": [_assistant(r["chosen"]) for r in rows],
                                      "rejected": [_assistant(r["rejected"]) for r in rows]},
        "conversational_implicit_prompt_preference": {
            "chosen": [_user(r["prompt"]) + _assistant(r["chosen"]) for r in rows],
            "rejected": [_user(r["prompt"]) + _assistant(r["rejected"]) for r in rows]},
        "conversational_unpaired_preference": {"prompt": [_user(r["prompt"]) for r in rows],
                                               "completion": [_assistant(c) for c in unpaired],
                                               "label": col("label")},
    }


def build_datasets(out: Path) -> List[str]:
    """``datasets/zen/CONFIG`` for every configuration (train 17 rows, test 2: upstream's split of 19)."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()

    names = []
    for name, columns in zen_configs().items():
        split = Dataset.from_dict(columns).train_test_split(test_size=0.1, shuffle=False)
        split.save_to_disk(str(out / "datasets" / "zen" / name))
        names.append(f"zen/{name}")
    return names


def base_tokenizer():
    """A byte-level BPE (``VOCAB`` entries) trained on the zen texts, both families' special tokens in its vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = [v if isinstance(v, str) else json.dumps(v) for cols in zen_configs().values()
             for values in cols.values() for v in values]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=QWEN_SPECIALS + LLAMA_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens(QWEN_ADDED)
    return tok


def _template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def qwen_tokenizer(template: str):
    """Qwen 2.5 / 3's conventions: pad ``<|endoftext|>``, EOS ``<|im_end|>``, no BOS token added."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=base_tokenizer(), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=_template(template),
                                   model_max_length=131072)


def llama_tokenizer():
    """Llama 3.2's conventions: ``<|begin_of_text|>`` added in front, EOS ``<|eot_id|>``, no pad token."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = base_tokenizer()
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   chat_template=_template("llama3_2"), model_max_length=131072)


def _ids(tok, eos: str, bos: str) -> Dict[str, int]:
    return {"bos_token_id": tok.convert_tokens_to_ids(bos), "eos_token_id": tok.convert_tokens_to_ids(eos),
            "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>" if bos == "<|endoftext|>" else eos)}


def model_specs() -> Dict[str, Callable]:
    """Model id -> a function giving (model, tokenizer, generation config); the dims of TRL's own tiny models."""
    import transformers as tf

    def qwen(config_cls, model_cls, hidden, template, **extra):
        def make():
            tok = qwen_tokenizer(template)
            ids = _ids(tok, "<|im_end|>", "<|endoftext|>")
            config = config_cls(vocab_size=len(tok), hidden_size=hidden, num_attention_heads=4,
                                num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32, **ids, **extra)
            gen = tf.GenerationConfig(bos_token_id=ids["bos_token_id"], pad_token_id=ids["pad_token_id"],
                                      eos_token_id=[ids["eos_token_id"], ids["bos_token_id"]])
            return model_cls(config), tok, gen
        return make

    def llama(model_cls, hidden, **extra):
        def make():
            tok = llama_tokenizer()
            ids = _ids(tok, "<|eot_id|>", "<|begin_of_text|>")
            config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=hidden, num_attention_heads=4,
                                    num_key_value_heads=2, num_hidden_layers=2, intermediate_size=32,
                                    tie_word_embeddings=True, **ids, **extra)
            gen = tf.GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"])
            return model_cls(config), tok, gen
        return make

    moe = dict(num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, head_dim=128)
    return {
        f"{ORG}/tiny-Qwen2ForCausalLM-2.5": qwen(tf.Qwen2Config, tf.Qwen2ForCausalLM, 8, "qwen2_5"),
        f"{ORG}/tiny-Qwen2ForSequenceClassification-2.5": qwen(tf.Qwen2Config, tf.Qwen2ForSequenceClassification,
                                                                 16, "qwen2_5", num_labels=1),
        f"{ORG}/tiny-Qwen3ForCausalLM": qwen(tf.Qwen3Config, tf.Qwen3ForCausalLM, 8, "qwen3"),
        f"{ORG}/tiny-Qwen3ForSequenceClassification": qwen(tf.Qwen3Config, tf.Qwen3ForSequenceClassification, 16,
                                                            "qwen3", num_labels=1),
        f"{ORG}/tiny-Qwen3MoeForCausalLM": qwen(tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, 8, "qwen3", **moe),
        f"{ORG}/tiny-LlamaForCausalLM-3.2": llama(tf.LlamaForCausalLM, 8),
        f"{ORG}/tiny-LlamaForSequenceClassification-3.2": llama(tf.LlamaForSequenceClassification, 16,
                                                                 num_labels=1),
    }


def init_tiny(model) -> None:
    """Upstream's ``init_weights_tiny_model`` rule: Xavier-uniform linear weights, zero biases, N(0, 0.02)
    embeddings, unit norms (no NaN from an uninitialised tensor)."""
    import torch
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):  # RMSNorm: ones, as its own init
                param.fill_(1.0)


def _snapshot_rev(folder: Path) -> str:
    """A commit-like id (40 hex) from the files' names and contents: the same files, the same revision."""
    digest = hashlib.sha1()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build_models(out: Path) -> List[str]:
    """Each model under ``hub/models--ORG--NAME/snapshots/REV`` with ``refs/main`` naming REV (the Hub's layout)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    built = []
    for seed, (model_id, make) in enumerate(model_specs().items()):
        torch.manual_seed(seed)
        model, tok, gen = make()
        init_tiny(model)
        model = model.to(dtype=torch.bfloat16)
        staging = out / "staging" / model_id.replace("/", "--")
        model.save_pretrained(staging)
        tok.save_pretrained(staging)
        gen.save_pretrained(staging)
        repo = out / "hub" / f"models--{model_id.replace('/', '--')}"
        rev = _snapshot_rev(staging)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(rev)
        (repo / "snapshots").mkdir(exist_ok=True)
        shutil.move(str(staging), str(repo / "snapshots" / rev))
        built.append(model_id)
    shutil.rmtree(out / "staging", ignore_errors=True)
    return built


def build(out: Path) -> Dict[str, object]:
    """Build every stand-in into ``out`` (emptied first) and write ``out/standins.json`` (what is there)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    manifest = {"version": STANDINS_VERSION, "models": build_models(out), "datasets": build_datasets(out)}
    (out / "standins.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def ensure(out: Path) -> Path:
    """Build into ``out`` unless a build of this version is there already (the harness calls this)."""
    manifest = out / "standins.json"
    if not manifest.is_file() or json.loads(manifest.read_text()).get("version") != STANDINS_VERSION:
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent if out.parent.exists() else None))
        build(tmp / "b")
        if out.exists():
            shutil.rmtree(out)
        shutil.move(str(tmp / "b"), str(out))
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def tree_digest(root: Path) -> Dict[str, str]:
    """Relative path -> sha256 of every file under ``root`` (for ``--check``)."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_DIR, help=f"where to build (default {DEFAULT_DIR})")
    parser.add_argument("--check", action="store_true", help="build twice and compare the files byte for byte")
    args = parser.parse_args(argv)
    manifest = build(Path(args.out))
    print(f"built {len(manifest['models'])} models and {len(manifest['datasets'])} data sets in {args.out}")
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp) / "again")
            first, second = tree_digest(Path(args.out)), tree_digest(Path(tmp) / "again")
        differ = sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
        if differ:
            print(f"not deterministic: {len(differ)} files differ between two builds, e.g. {differ[:5]}")
            return 1
        print(f"deterministic: two builds give the same {len(first)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
