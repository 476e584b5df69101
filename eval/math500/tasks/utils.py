"""Prompting and math-verify scoring for the ``hl_math500`` lm-eval task (self-contained: lm-eval loads
this file by path from the task YAML, so it imports nothing from the ``eval`` package).

Rows follow the ``HuggingFaceH4/MATH-500`` schema: ``problem``, ``solution``, ``answer``, ``subject``,
``level``, ``unique_id``. With ``repeats: n`` and the ``take_first_k`` filter (k = n) each problem gets
its n sampled completions; `process_results` marks each one correct or not with math-verify, and
the aggregations turn the per-problem lists into:

* ``pass@1``: mean correctness over all problems and samples;
* ``pass@1_std``: population standard deviation (ddof = 0) across the n samples of the per-sample
  pass@1 (sample j's accuracy over all problems), i.e. the "mean +- std across samples" of the paper;
  0 when n = 1;
* ``pass@n``: fraction of problems with at least one correct sample.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Dict, List, Optional

# The open-r1 system prompt the paper's MATH runs used (reasoning in <think>, answer in <answer>).
SYSTEM_PROMPT_R1 = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>"
)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

PROMPTS = ("r1", "boxed", "minerva")

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_LATEX_DELIMS = ("$", "\\(", "\\[", "\\boxed", "\\fbox")
_COMMAND = re.compile(r"\\(?:begin|end)\{[^}]*\}|\\[A-Za-z]+")
_WORD = re.compile(r"[A-Za-z]{3,}")


# --------------------------------------------------------------------------------------------- prompts


def doc_to_text(doc: Dict[str, Any]) -> str:
    """``r1`` prompt: the problem alone (the system prompt goes in through the chat template)."""
    return doc["problem"]


def doc_to_text_boxed(doc: Dict[str, Any]) -> str:
    """``boxed`` prompt (Qwen2.5-Math style): the problem, then the \\boxed{} instruction."""
    return doc["problem"] + "\n\n" + BOXED_INSTRUCTION


def doc_to_text_minerva(doc: Dict[str, Any]) -> str:
    """``minerva`` prompt (base models, no chat template): ``Problem:\\n...\\n\\nSolution:``."""
    return "Problem:\n" + doc["problem"] + "\n\nSolution:"


def doc_to_target(doc: Dict[str, Any]) -> str:
    return gold_answer_text(doc)


# --------------------------------------------------------------------------------------------- scoring


def _timeouts():
    """math-verify's timeouts use signal.alarm, which only works in the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def gold_answer_text(doc: Dict[str, Any]) -> str:
    answer = doc.get("answer")
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    solution = doc.get("solution") or ""
    boxed = _last_boxed(solution)
    return boxed if boxed is not None else solution


def _last_boxed(text: str) -> Optional[str]:
    idx = text.rfind("\\boxed{")
    if idx < 0:
        return None
    i, depth, start = idx + len("\\boxed{"), 1, idx + len("\\boxed{")
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def parse_gold(doc: Dict[str, Any]):
    from math_verify import parse

    t = _timeouts()
    gold = parse("\\boxed{" + gold_answer_text(doc) + "}", parsing_timeout=t)
    if not gold and doc.get("solution"):
        gold = parse(doc["solution"], parsing_timeout=t)
    return gold


def extract_answer_text(completion: str) -> str:
    """The part of a completion holding the answer: the last ``<answer>...</answer>`` block (or the text
    after an unclosed final ``<answer>``); the whole completion when there is no answer tag."""
    blocks = _ANSWER_TAG.findall(completion)
    if blocks:
        return blocks[-1].strip()
    i = completion.rfind("<answer>")
    if i >= 0:
        return completion[i + len("<answer>"):].strip()
    return completion


def _is_bare_math(text: str) -> bool:
    """No LaTeX delimiter and no English words (``\\commands`` aside): e.g. ``3\\sqrt{2}``, ``(2,3)``."""
    if not text or any(d in text for d in _LATEX_DELIMS):
        return False
    return _WORD.search(_COMMAND.sub(" ", text)) is None


def parse_prediction(completion: str):
    """math-verify ``parse`` of the answer part. A bare answer (no ``$``/``\\(``/``\\[``/``\\boxed``
    delimiter and no words, e.g. ``3\\sqrt{2}`` inside ``<answer>``) is parsed as if it were boxed first
    (plain parsing would read ``3\\sqrt{2}`` as ``3``), then as is."""
    from math_verify import parse

    t = _timeouts()
    text = extract_answer_text(completion).strip()
    if _is_bare_math(text):
        pred = parse("\\boxed{" + text + "}", parsing_timeout=t)
        if pred:
            return pred
    return parse(text, parsing_timeout=t)


def is_correct(completion: str, doc: Dict[str, Any], gold=None) -> bool:
    from math_verify import verify

    gold = parse_gold(doc) if gold is None else gold
    pred = parse_prediction(completion)
    if not gold or not pred:
        return False
    try:
        return bool(verify(gold, pred, timeout_seconds=_timeouts()))
    except Exception:
        return False


def process_results(doc: Dict[str, Any], results: List[Any]) -> Dict[str, List[int]]:
    """``results[0]``: the n completions of this problem (``take_first_k``) or one string."""
    completions = results[0]
    if isinstance(completions, str):
        completions = [completions]
    gold = parse_gold(doc)
    correct = [int(is_correct(c, doc, gold)) for c in completions]
    return {"pass@1": correct, "pass@1_std": correct, "pass@n": correct}


# --------------------------------------------------------------------------------------------- aggregation


def _matrix(items: List[Any]) -> List[List[int]]:
    rows = [[int(v) for v in (it if isinstance(it, (list, tuple)) else [it])] for it in items]
    return [r for r in rows if r]


def per_sample_pass_at_1(items: List[Any]) -> List[float]:
    """Sample j's accuracy over the problems (problems with fewer samples count where they have one)."""
    rows = _matrix(items)
    if not rows:
        return []
    n = max(len(r) for r in rows)
    out = []
    for j in range(n):
        col = [r[j] for r in rows if len(r) > j]
        out.append(sum(col) / len(col))
    return out


def agg_pass_at_1(items: List[Any]) -> float:
    rows = _matrix(items)
    total = sum(len(r) for r in rows)
    return sum(sum(r) for r in rows) / total if total else float("nan")


def agg_pass_at_1_std(items: List[Any]) -> float:
    accs = per_sample_pass_at_1(items)
    if not accs:
        return float("nan")
    mean = sum(accs) / len(accs)
    return math.sqrt(sum((a - mean) ** 2 for a in accs) / len(accs))


def agg_pass_at_n(items: List[Any]) -> float:
    rows = _matrix(items)
    return sum(max(r) for r in rows) / len(rows) if rows else float("nan")
