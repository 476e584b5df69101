"""The preference study (``python -m eval.repro --study preference``): does humanline close the offline-online
gap for DPO, KTO and GRPO, the paper's instruction-following experiment in miniature?

* Task: the toy addition prompts, scored by a graded reward that is an exact, known function of the completion
  (:func:`digit_credit`: per-digit credit minus a length penalty), so "better" is never a judge's opinion and
  there is room to improve over the warm-up policy (which copies a noisy demonstrator).
* Offline data: written once by a *different, weaker* model (a shorter warm-up from another seed, as the paper's
  offline sets came from other models): ``SAMPLES`` completions per training prompt, scored by the same reward,
  best vs worst (:func:`build_offline_data`): DPO pairs, the same pairs split into KTO examples, and the same two
  completions as GRPO groups of two, taken among the non-empty samples (the loaders refuse empty completions).
  Prompts whose samples all score the same, or with fewer than two non-empty samples, are left out and counted.
* Arms per objective: offline, online (best vs worst of fresh samples every update; GRPO on fresh groups),
  offline + humanline (k = 1, clip +-1.5); for DPO also sync-only and clip-only. Every arm: the same updates and
  prompts per update, held-out mean reward of one sampled completion per prompt and its win rate against the
  start policy (``eval.held_out: reward``).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hl_core.storage.digests import sha256_file

from .._common import read_jsonl

REPO = Path(__file__).resolve().parents[2]
PROMPTS = REPO / "tests" / "fixtures" / "toy_add" / "prompts_train.jsonl"
ANSWER_DIGITS = 3
SAMPLES = 4  # completions per prompt the offline model writes; best vs worst become the pair
DATA_SEED = 4242
# the offline data's model: a shorter warm-up from another seed (weaker than the policy's warm-up)
WEAK_WARMUP_OVERRIDES = ("train.max_steps=120",)
WEAK_SEED = 1000


def digit_credit(prompts, completions: Sequence[str], references: Sequence[Optional[str]]) -> List[float]:
    """Per completion: ``(matching digits - 0.5 * |length - 3|) / 3`` against the zero-padded 3-digit answer.

    ``1`` for the exact answer; a digit in the wrong place earns nothing; each character too many or too few
    costs half a digit. A missing reference is a ``ValueError`` (the toy prompts always carry one)."""
    scores = []
    for completion, reference in zip(completions, references):
        if reference is None:
            raise ValueError("digit_credit needs the reference answer of every prompt")
        target = f"{int(reference):0{ANSWER_DIGITS}d}"
        text = "".join(str(completion).split())
        matches = sum(a == b for a, b in zip(text, target))
        scores.append((matches - 0.5 * abs(len(text) - len(target))) / len(target))
    return scores


def file_digest(path: Path) -> str:
    return sha256_file(path)


def _key(model_dir: Path, prompts: Path) -> str:
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in (".safetensors", ".bin"))
    # "nonempty": the pair is taken among non-empty samples (a change of the data, so a new cache key)
    digest = hashlib.sha256(prompts.read_bytes() + repr((SAMPLES, DATA_SEED, "nonempty")).encode())
    for path in weights:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_offline_data(model_dir: Path, out: Path, prompts_path: Path = PROMPTS, limit: Optional[int] = None,
                       batch: int = 256) -> Dict[str, Path]:
    """Sample ``SAMPLES`` completions per prompt from ``model_dir`` (temperature 1, each prompt under its own
    seed), score them with :func:`digit_credit` and write ``pairs.jsonl`` (prompt, chosen, rejected),
    ``groups.jsonl`` (prompt, [chosen, rejected], their scores) and ``meta.json`` under ``out/offline-<key>``.
    Cached by the model's weights, the prompts and the sampling settings; returns the paths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hl_core.data.tokens import encode_prompt, prompt_text
    from hl_core.rollout.generation import prompt_seed, sample_groups
    from hl_core.rollout.rewards import best_and_worst

    directory = out / f"offline-{_key(model_dir, prompts_path)}"
    paths = {"pairs": directory / "pairs.jsonl", "groups": directory / "groups.jsonl", "meta": directory / "meta.json"}
    if paths["meta"].exists():
        print(f"offline data: cached at {directory}")
        return paths
    rows = read_jsonl(prompts_path)[:limit]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    pairs, groups, all_scores, ties, empty, unpaired = [], [], [], 0, 0, 0
    for first in range(0, len(rows), batch):
        chunk = rows[first:first + batch]
        ids = [encode_prompt(prompt_text([{"role": "user", "content": r["prompt"]}], tokenizer, "raw"), tokenizer)
               for r in chunk]
        sampled = sample_groups(model, [(p, SAMPLES, prompt_seed(DATA_SEED, first + i)) for i, p in enumerate(ids)],
                                max_new_tokens=ANSWER_DIGITS + 1, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id, temperature=1.0)
        for row, completions in zip(chunk, sampled):
            texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
            scores = digit_credit(None, texts, [row["answer"]] * len(texts))
            all_scores += scores
            # an empty completion (the model stopped at once) is no answer to prefer or reject: the data loaders
            # refuse empty completions, so pairs are taken among the non-empty samples (all counted in meta)
            usable = [i for i, text in enumerate(texts) if text.strip()]
            empty += len(texts) - len(usable)
            if len(usable) < 2:
                unpaired += 1
                continue
            best, worst, keep = best_and_worst([scores[i] for i in usable], 0.0)
            best, worst = usable[best], usable[worst]
            if not keep or texts[best] == texts[worst]:
                ties += 1
                continue
            pairs.append({"prompt": row["prompt"], "chosen": texts[best], "rejected": texts[worst]})
            groups.append({"prompt": row["prompt"], "completions": [texts[best], texts[worst]],
                           "scores": [scores[best], scores[worst]]})
    directory.mkdir(parents=True, exist_ok=True)
    for name, items in (("pairs", pairs), ("groups", groups)):
        paths[name].write_text("".join(json.dumps(item) + "\n" for item in items))
    meta = {"model": str(model_dir), "prompts": len(rows), "pairs": len(pairs), "left_out_all_tied": ties,
            "empty_samples_not_paired": empty, "left_out_fewer_than_two_nonempty": unpaired,
            "samples_per_prompt": SAMPLES, "sample_reward_mean": statistics.fmean(all_scores),
            "chosen_reward_mean": statistics.fmean(g["scores"][0] for g in groups),
            "rejected_reward_mean": statistics.fmean(g["scores"][1] for g in groups),
            "sha256": {name: file_digest(paths[name]) for name in ("pairs", "groups")}}
    paths["meta"].write_text(json.dumps(meta, indent=2) + "\n")
    print(f"offline data: {len(pairs)} pairs from {len(rows)} prompts ({ties} all tied and {unpaired} with fewer than "
          f"two non-empty samples, left out; {empty} empty samples not paired); mean reward of "
          f"the weaker model's samples {meta['sample_reward_mean']:.3f} -> {directory}")
    return paths
