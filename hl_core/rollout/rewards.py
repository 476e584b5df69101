"""Rewards for rollouts: verifiable math answers, a sequence-classification reward model, or a user callable.

Every reward maps ``(prompts, completions, references) -> list[float]`` (one score per completion);
``prompts`` are chat-message lists, ``references`` the data set's reference answers (or None).
"""

from __future__ import annotations

import inspect
import math
import re
from decimal import Decimal
from typing import Callable, Dict, List, Optional, Sequence

import torch

from ..callbacks import load_callable  # the one `package.module:name` loader (train.callbacks too)
from ..data.prompts import last_boxed
from ..errors import RecipeError

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL | re.IGNORECASE)


def extract_answer(completion: str) -> Optional[str]:
    """The final answer's text: the last ``<answer>...</answer>``, else the last ``\\boxed{...}``, else the
    whole completion (math-verify then finds an expression in it, or nothing). ``None`` for empty output."""
    if not isinstance(completion, str) or not completion.strip():
        return None
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        inner = tagged[-1].strip()
        boxed = last_boxed(inner)
        return boxed if boxed is not None else inner
    boxed = last_boxed(completion)
    return boxed if boxed is not None else completion


def _parse(text: str):
    from math_verify import (
        parse,  # imported here: only the math reward needs it (sympy is slow to import)
    )

    for candidate in (text if text.strip().startswith("$") else f"${text}$", text):
        try:
            parsed = parse(candidate, parsing_timeout=5)
        except Exception:  # math-verify must never take training down on model garbage
            parsed = []
        if parsed:
            return parsed
    return []


_PLAIN_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?$")


def _plain_number(text: str) -> Optional[Decimal]:
    """``text`` as an exact decimal when it is a plain (signed, optionally fractional) number, else None."""
    text = text.strip()
    return Decimal(text) if _PLAIN_NUMBER.match(text) else None


def math_correct(completion: str, reference: Optional[str]) -> bool:
    """True when the completion's final answer is mathematically equal to ``reference`` (math-verify).
    Fast path: when both are plain numbers (``-12``, ``0570``, ``1.50``) they are compared exactly as
    decimals, which is what math-verify concludes for them, ~1000x sooner."""
    from math_verify import verify  # imported here: as parse

    if reference is None:
        raise ValueError("math reward needs a reference answer")
    answer = extract_answer(completion)
    if answer is None:
        return False
    gold_number, pred_number = _plain_number(str(reference)), _plain_number(answer)
    if gold_number is not None and pred_number is not None:
        return gold_number == pred_number
    gold, pred = _parse(str(reference)), _parse(answer)
    if not gold or not pred:
        return False
    try:
        return bool(verify(gold, pred, timeout_seconds=5))
    except Exception:
        return False


def format_ok(completion: str, style: str = "lenient") -> bool:
    """The MATH runs' format term. ``lenient``: ``<think>...</think><answer>...</answer>`` with any whitespace
    around the tags and nothing else. ``newlines``: the open-r1 fork's rule, each tag on its own line
    (``<think>\n...\n</think>\n<answer>\n...\n</answer>``), the answer's closing tag at the end of a line."""
    if not isinstance(completion, str):
        return False
    if style == "newlines":
        return bool(_FORMAT_NEWLINES.match(completion))
    return bool(_FORMAT.match(completion))


_FORMAT_NEWLINES = re.compile(r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
# the four markers the open-r1 fork's tag-count term looks for, each worth 0.25 when it occurs exactly once
TAG_MARKERS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")


def tag_count(completion: str) -> float:
    """0.25 for each of `TAG_MARKERS` that occurs exactly once in ``completion`` (0 to 1)."""
    if not isinstance(completion, str):
        return 0.0
    return 0.25 * sum(completion.count(marker) == 1 for marker in TAG_MARKERS)


class MathReward:
    """``accuracy_weight * [answer == reference] + format_weight * [format] + tag_count_weight * tag_count``."""

    needs_reference = True

    def __init__(self, cfg):
        self.accuracy_weight = cfg.accuracy_weight
        self.format_weight = cfg.format_weight
        self.format_style = cfg.format_style
        self.tag_count_weight = cfg.tag_count_weight

    def __call__(self, prompts, completions, references) -> List[float]:
        scores = []
        for completion, reference in zip(completions, references):
            score = self.accuracy_weight * float(math_correct(completion, reference))
            if self.format_weight:
                score += self.format_weight * float(format_ok(completion, self.format_style))
            if self.tag_count_weight:
                score += self.tag_count_weight * tag_count(completion)
            scores.append(score)
        return scores


class RewardModelReward:
    """A Hugging Face sequence-classification model (e.g. ArmoRM) scoring prompt + completion in batches."""

    needs_reference = False

    def __init__(self, cfg):
        # imported here: only a reward model needs it
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if not cfg.model:
            raise RecipeError("`rollout.reward.kind: reward_model` needs `rollout.reward.model` (a model name or "
                              "directory).")
        self.device = torch.device("cuda",
                                   torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            cfg.model, trust_remote_code=cfg.trust_remote_code, dtype=dtype
        ).to(self.device).eval()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = cfg.batch_size
        self.score_index = cfg.score_index

    def _text(self, prompt, completion) -> str:
        messages = list(prompt) + [{"role": "assistant", "content": completion}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n\n".join(m["content"] for m in messages)

    def __call__(self, prompts, completions, references) -> List[float]:
        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        scores: List[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=True, add_special_tokens=False).to(self.device)
            with torch.no_grad():
                out = self.model(**enc)
            values = out.score if getattr(out, "score", None) is not None else out.logits[:, self.score_index]
            scores.extend(float(v) for v in values.float().reshape(-1))
        return scores


class CallableReward:
    """``rollout.reward.function: "package.module:function"``, called as ``fn(prompts, completions, references)``."""

    needs_reference = False

    def __init__(self, cfg):
        self.fn = load_callable(cfg.function, "rollout.reward.function")
        check_reward_signature(self.fn, cfg.function)

    def __call__(self, prompts, completions, references) -> List[float]:
        returned = self.fn(prompts, completions, references)
        try:
            scores = list(returned)
        except TypeError:
            scores = None
        if scores is None or len(scores) != len(completions):
            got = f"{len(scores)} scores" if scores is not None else f"a {type(returned).__name__}"
            raise RecipeError(
                f"`rollout.reward.function` returned {got} for {len(completions)} completions. "
                "Fix: return a list of one float per completion."
            )
        return [self._checked(score, i) for i, score in enumerate(scores)]

    @staticmethod
    def _checked(score, index: int) -> float:
        """A finite real number (ints, floats, numpy/torch scalars; not text, not a bool)."""
        value = None
        if not isinstance(score, (str, bytes, bool)):
            try:
                value = float(score)
            except (TypeError, ValueError, OverflowError):
                pass
        if value is None or not math.isfinite(value):
            raise RecipeError(
                f"`rollout.reward.function` returned {score!r} ({type(score).__name__}) as the score of completion "
                f"{index}: a score must be a finite number, or the advantages and the loss turn into NaN. Fix: return "
                "one finite float per completion (e.g. 0.0 for an output the function cannot score)."
            )
        return value


REWARD_SIGNATURE = "fn(prompts, completions, references) -> list of float"


def check_reward_signature(fn: Callable, spec: str) -> None:
    """``fn`` can be called as ``fn(prompts, completions, references)`` (three positional lists); a function of
    another signature (``os:system``) is refused before it is ever called, naming its own signature. A callable
    whose signature Python cannot read (some builtins) passes here and is checked by its results."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        signature.bind([], [], [])
    except TypeError as exc:
        raise RecipeError(
            f"`rollout.reward.function: {spec}` has the signature `{spec.partition(':')[2]}{signature}`, but a reward "
            f"function is called as `{REWARD_SIGNATURE}`: the prompts, the sampled completions and the references "
            f"(None for a row without one), one score per completion ({exc}). Nothing was called. Fix: point "
            "`rollout.reward.function` at a function of that signature, e.g. `def score(prompts, completions, "
            "references): return [1.0 if ... else 0.0 for c in completions]`."
        ) from None


REWARDS: Dict[str, Callable] = {"math": MathReward, "reward_model": RewardModelReward, "callable": CallableReward}


def build_reward(reward_cfg):
    return REWARDS[reward_cfg.kind](reward_cfg)


def reward_needs_reference(kind: str) -> bool:
    return REWARDS[kind].needs_reference


def best_and_worst(scores: Sequence[float], threshold: float):
    """Indices ``(best, worst)`` of a prompt's generations and whether ``max - min > threshold``.

    Ties go to the earliest generation, so the choice is deterministic.
    """
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))
    worst = min(range(len(scores)), key=lambda i: (scores[i], i))
    return best, worst, (scores[best] - scores[worst]) > threshold
