"""Packed against padded micro-batches on long-tailed preference data, side by side in one process.

    python bench/packing.py                    # 16 updates, padded and packed alternating (about 2 min on 2 cores)
    python bench/packing.py --updates 8 --micro-batch 4

Data: preference pairs whose completion lengths are log-normal (median 150 tokens, 95th percentile about 900,
capped so prompt + completion fit ``data.max_length`` 2048), the shape of UltraFeedback's long tail. Model: a
Qwen2.5-shaped model narrowed to what a 2-core CPU trains in seconds (hidden 512, 4 layers, 8 heads / 2 KV heads,
MLP 1408, vocabulary 8192, random init, sdpa attention), humanline DPO (k = 1, clip) through our trainer and the
DeepSpeed engine (ZeRO-0, fp32).

One trainer runs every update; ``data.packing`` is switched before each one (padded, packed, padded, ...), so
both modes see the same weights trajectory, examples per update and machine load. Per mode it prints the padding
fraction of the forwards (positions that are not real tokens), real tokens per second, the peak resident memory
inside an update above the process's memory at rest, and the ratio packed / padded. The first update (allocating
the optimizer states) is not timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.memprobe import GIB, RssProbe  # noqa: E402
from bench.shapes import _WORDS, TOKENIZER_DIR, _text, spec_of, write_model_dir  # noqa: E402

MAX_LENGTH, PROMPT_TOKENS = 2048, 24
MEDIAN, P95 = 150, 900
SIGMA = math.log(P95 / MEDIAN) / 1.6449  # the 95th percentile of a standard normal


def long_tailed_pairs(path: Path, rows: int, seed: int = 0, max_length: int = MAX_LENGTH) -> list:
    """``rows`` pairs with log-normal completion lengths (tokens), capped to fit ``max_length``; returns the
    lengths written."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    counts = {(w, first): len(tokenizer(w if first else " " + w, add_special_tokens=False)["input_ids"])
              for w in _WORDS for first in (True, False)}
    rng = random.Random(seed)
    cap = max_length - PROMPT_TOKENS - 8  # room for the chat template's tokens and the EOS
    lengths = []
    with open(path, "w") as handle:
        for _ in range(rows):
            sizes = [min(cap, max(4, int(rng.lognormvariate(math.log(MEDIAN), SIGMA)))) for _ in range(2)]
            lengths += sizes
            prompt = _text(rng, counts, PROMPT_TOKENS)
            chosen, rejected = (_text(rng, counts, n) for n in sizes)
            handle.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    return lengths


def positions(batches, packing: bool, capacity: int, pad: int) -> int:
    """Forward positions (rows x width) the micro-batches cost, padded or packed."""
    from hl_core.logprobs.packed import pack_rows

    total = 0
    for batch in batches:
        if packing:
            total += pack_rows(batch["input_ids"], batch["attention_mask"], capacity, pad).input_ids.numel()
        else:
            total += batch["input_ids"].numel()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=16, help="timed updates, half in each mode")
    parser.add_argument("--micro-batch", type=int, default=4, help="pairs per micro-batch (= per update)")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    args = parser.parse_args()

    import torch

    from hl_core.config import load_recipe
    from hl_core.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    spec = spec_of("qwen2.5-1.5b", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=2,
                   intermediate_size=1408, vocab_size=8192, head_dim=None, max_position_embeddings=4096)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = write_model_dir(spec, tmp / "model")
        lengths = long_tailed_pairs(tmp / "pairs.jsonl", rows=(args.updates + 1) * args.micro_batch)
        recipe = load_recipe(REPO / "recipes" / "tiny" / "humanline_dpo.yaml", [
            f"model.name_or_path={model_dir}", "model.attn_implementation=sdpa",
            f"data.train.path={tmp / 'pairs.jsonl'}",
            "data.eval=null", "eval.every=null", f"data.max_length={MAX_LENGTH}", "data.max_prompt_length=64",
            "data.shuffle=false", f"train.micro_batch_size={args.micro_batch}", f"train.max_steps={args.updates + 1}",
            "train.lr=1e-5",
            "checkpoint.save_every=null", "checkpoint.save_final=false", f"output_dir={tmp / 'run'}",
            "logging.progress_bar=false"])
        trainer = Trainer(recipe)
        trainer.setup()
        probe = RssProbe()
        trainer.train_step()  # allocates the optimizer states: not timed
        stats = {mode: {"seconds": 0.0, "tokens": 0, "positions": 0, "peak_gib": 0.0, "losses": []}
                 for mode in ("padded", "packed")}
        pad = trainer.tokenizer.pad_token_id or 0
        for n in range(1, args.updates + 1):
            mode = "packed" if n % 2 == 0 else "padded"
            recipe.data.packing = mode == "packed"  # the collate reads the data section; the engine, its spec
            trainer.engine.spec = dataclasses.replace(trainer.engine.spec, packing=recipe.data.packing)
            batches = trainer.source.batches(n)
            entry = stats[mode]
            entry["tokens"] += sum(int(b["attention_mask"].sum()) for b in batches)
            entry["positions"] += positions(batches, recipe.data.packing, MAX_LENGTH, pad)
            rest = probe.current()
            probe.reset_peak()
            start = time.perf_counter()
            row = trainer.train_step()
            entry["seconds"] += time.perf_counter() - start
            entry["peak_gib"] = max(entry["peak_gib"], (probe.peak() - rest) / GIB)
            entry["losses"].append(row["loss"])
            print(f"update {n:2d} {mode:6s}: {row['step_time_s']:6.1f}s, loss {row['loss']:.4f}", flush=True)
        trainer.close()
    for entry in stats.values():
        entry["tokens_per_s"] = entry["tokens"] / entry["seconds"]
        entry["padding_frac"] = 1.0 - entry["tokens"] / entry["positions"]
    padded, packed = stats["padded"], stats["packed"]
    ordered = sorted(lengths)
    result = {
        "data": {"median_completion": ordered[len(ordered) // 2], "p95_completion": ordered[int(0.95 * len(ordered))],
                 "max_completion": ordered[-1], "pairs_per_update": args.micro_batch},
        "model": {"hidden": spec.hidden_size, "layers": spec.num_layers, "vocab": spec.vocab_size},
        "padded": padded, "packed": packed,
        "speedup": packed["tokens_per_s"] / padded["tokens_per_s"], "peak_ratio": packed["peak_gib"]
        / padded["peak_gib"],
        "cpu_count": os.cpu_count(), "torch": torch.__version__,
    }
    print(f"\ncompletion tokens: median {result['data']['median_completion']}, 95th percentile "
          f"{result['data']['p95_completion']}, max {result['data']['max_completion']}; "
          f"{args.micro_batch} pairs per update, {args.updates // 2} updates per mode\n")
    print("| mode | padding fraction | real tokens/s | peak GiB in an update |")
    print("|---|---:|---:|---:|")
    for mode, entry in stats.items():
        print(f"| {mode} | {entry['padding_frac']:.2f} | {entry['tokens_per_s']:,.0f} | {entry['peak_gib']:.2f} |")
    print(f"\npacked / padded: {result['speedup']:.2f}x real tokens/s, {result['peak_ratio']:.2f}x peak memory")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
