"""The preference study (``python -m eval.repro --study preference``): does humanline close the offline-online
gap for DPO, KTO and GRPO, the paper's instruction-following experiment in miniature?

* Task: the toy addition prompts, scored by a graded reward that is an exact, known function of the completion
  (`digit_credit`: per-digit credit minus a length penalty), so "better" is never a judge's opinion and
  there is room to improve over the warm-up policy (which copies a noisy demonstrator).
* Offline data: written once by a *different, weaker* model (a shorter warm-up from another seed, as the paper's
  offline sets came from other models): ``SAMPLES`` completions per training prompt, scored by the same reward,
  best vs worst (``eval.repro.sources``, source ``weak``): DPO pairs, the same pairs split into KTO examples, and
  the same two completions as GRPO groups of two, taken among the non-empty samples (the loaders refuse empty
  completions). Prompts whose samples all score the same, or with fewer than two non-empty samples, are left out
  and counted.
* Arms per objective: offline, online (best vs worst of fresh samples every update; GRPO on fresh groups),
  offline + humanline (k = 1, clip +-1.5); for DPO also sync-only and clip-only. Every arm: the same updates and
  prompts per update, held-out mean reward of one sampled completion per prompt and its win rate against the
  start policy (``eval.held_out: reward``).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

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
