"""Prompting and scoring for the ``hl_math500`` lm-eval task (self-contained: lm-eval loads this file by path from
the task YAML, so it imports nothing from the ``eval`` package; it loads ``answer.py`` next to it by path).

Scoring: the answer a completion gives and its normal form (``answer.py``: the last boxed answer or answer tag,
thousands separators, trailing periods, repeating decimals, scientific notation, percentages), then a text comparison
for text golds or math-verify's ``verify``, with the LaTeX parser runtime pinned (`check_parser_runtime`).

Rows follow the ``HuggingFaceH4/MATH-500`` schema: ``problem``, ``solution``, ``answer``, ``subject``,
``level``, ``unique_id``. With ``repeats: n`` and the ``take_first_k`` filter (k = n) each problem gets
its n sampled completions; `process_results` marks each one correct or not, and
the aggregations turn the per-problem lists into:

* ``pass@1``: mean correctness over all problems and samples;
* ``pass@1_std``: population standard deviation (ddof = 0) across the n samples of the per-sample
  pass@1 (sample j's accuracy over all problems), i.e. the "mean +- std across samples" of the paper;
  0 when n = 1;
* ``pass@n``: fraction of problems with at least one correct sample.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
import threading
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional

# The open-r1 system prompt the paper's MATH runs used (reasoning in <think>, answer in <answer>).
SYSTEM_PROMPT_R1 = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The "
    "assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags, "
    "respectively, i.e., <think> reasoning process here </think><answer> answer here </answer>"
)
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

PROMPTS = ("r1", "boxed", "minerva")

# The LaTeX parser runtime the verdicts were checked with (tests/fixtures/math_graded_pairs.jsonl); setup.py's `eval`
# extra and requirements/cluster.txt pin the same version.
PARSER_RUNTIME = "antlr4-python3-runtime"
PARSER_RUNTIME_PIN = "4.13.2"
SCORER_PACKAGES = ("math-verify", "latex2sympy2_extended", PARSER_RUNTIME, "sympy")


class ParserRuntimeError(RuntimeError):
    """The installed LaTeX parser runtime is not the pinned one (the message says which and how to fix it)."""

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


def _load_answer_rules():
    """``answer.py`` next to this file (lm-eval loads this file by path, so a relative import would fail)."""
    name = "hl_math500_answer"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("answer.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


answer_rules = _load_answer_rules()


def installed_version(package: str) -> Optional[str]:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def parser_runtime_problem() -> Optional[str]:
    """None when the installed LaTeX parser runtime is the pinned one; else the paragraph that refuses to score."""
    installed = installed_version(PARSER_RUNTIME)
    if installed == PARSER_RUNTIME_PIN:
        return None
    found = f"this environment has {PARSER_RUNTIME} {installed}" if installed else f"{PARSER_RUNTIME} is not installed"
    return (
        f"MATH-500 answer checking is pinned to {PARSER_RUNTIME}=={PARSER_RUNTIME_PIN}, the LaTeX parser runtime "
        f"math-verify parses answers with (through latex2sympy2_extended), but {found}; the verdicts change with the "
        f"runtime (4.11 and 4.13 read percentages differently), so scores from here would not compare with the "
        f"pack's. Fix: `pip install {PARSER_RUNTIME}=={PARSER_RUNTIME_PIN}` (the pack's `eval` extra pins it) in this "
        f"environment, and run lm-eval's own MATH tasks (minerva_math wants 4.11) in a separate one "
        f"(docs/howto/evaluation.md)."
    )


def check_parser_runtime() -> None:
    """Raise `ParserRuntimeError` (the paragraph of `parser_runtime_problem`) unless the pinned runtime is installed.
    Call before anything imports math_verify: latex2sympy2_extended picks its generated parser at import."""
    problem = parser_runtime_problem()
    if problem is not None:
        raise ParserRuntimeError(problem)


def scorer_versions() -> Dict[str, Optional[str]]:
    """The versions the verdicts depend on (recorded in ``math500.json``)."""
    return {name: installed_version(name) for name in SCORER_PACKAGES}


def _timeouts():
    """math-verify's timeouts use signal.alarm, which only works in the main thread."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def gold_answer_text(doc: Dict[str, Any]) -> str:
    answer = doc.get("answer")
    if isinstance(answer, str) and answer.strip():
        return answer.strip()
    solution = doc.get("solution") or ""
    boxed = answer_rules.last_boxed(solution)
    return boxed if boxed is not None else solution


class Reference(NamedTuple):
    """A problem's gold answer, read once for its n completions: ``text`` its canonical words when the gold is a text
    answer (else None), ``parsed`` math-verify's parse of its normal form."""

    text: Optional[str]
    parsed: list


def parse_gold(doc: Dict[str, Any]) -> Reference:
    from math_verify import parse

    gold = gold_answer_text(doc)
    text = answer_rules.text_answer(gold)
    if text is not None:
        return Reference(text, [])
    t = _timeouts()
    parsed = parse("\\boxed{" + answer_rules.normalize(gold) + "}", parsing_timeout=t)
    if not parsed and doc.get("solution"):
        parsed = parse(doc["solution"], parsing_timeout=t)
    return Reference(None, parsed)


def extract_answer_text(completion: str) -> str:
    """The answer a completion gives, before normalisation (`answer.final_answer`)."""
    return answer_rules.final_answer(completion)[0]


def _is_bare_math(text: str) -> bool:
    """No LaTeX delimiter and no English words (``\\commands`` aside): e.g. ``3\\sqrt{2}``, ``(2,3)``."""
    if not text or any(d in text for d in _LATEX_DELIMS):
        return False
    return _WORD.search(_COMMAND.sub(" ", text)) is None


def parse_prediction(completion: str):
    """math-verify ``parse`` of the answer a completion gives (`answer.final_answer`), in normal form. A boxed answer,
    or a bare one (no delimiter, no words: ``3\\sqrt{2}`` inside ``<answer>``), is parsed as a boxed expression
    (plain parsing would read ``3\\sqrt{2}`` as ``3``); prose goes to math-verify, which finds its final answer."""
    from math_verify import parse

    t = _timeouts()
    text, boxed = answer_rules.final_answer(completion)
    if boxed or _is_bare_math(text.strip()):
        body = answer_rules.normalize(text)
        if not body or answer_rules.spaced_digits(body):
            return []
        pred = parse("\\boxed{" + body + "}", parsing_timeout=t)
        if pred or boxed:
            return pred
    return parse(answer_rules.normalize(text, whole_answer=False), parsing_timeout=t)


def text_verdict(completion: str, gold_text: str) -> bool:
    """A text gold against the completion's answer: the boxed answer, else the answer phrase of the prose."""
    text, boxed = answer_rules.final_answer(completion)
    given = text if boxed else answer_rules.text_in_prose(text)
    if not given:
        return False
    items = sorted(answer_rules.canonical_text(given).split(", "))
    return items == sorted(gold_text.split(", "))


def is_correct(completion: str, doc: Dict[str, Any], gold: Optional[Reference] = None) -> bool:
    """Whether ``completion`` gives the gold answer of ``doc``: the extraction rule and normal form of
    ``answer.py``, then the text comparison (text golds) or math-verify's ``verify``."""
    from math_verify import verify

    check_parser_runtime()
    gold = parse_gold(doc) if gold is None else gold
    if gold.text is not None:
        return text_verdict(completion, gold.text)
    pred = parse_prediction(completion)
    if not gold.parsed or not pred:
        return False
    try:
        return bool(verify(gold.parsed, pred, timeout_seconds=_timeouts()))
    except Exception:
        return False


def process_results(doc: Dict[str, Any], results: List[Any]) -> Dict[str, List[int]]:
    """``results[0]``: the n completions of this problem (``take_first_k``) or one string."""
    check_parser_runtime()
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
