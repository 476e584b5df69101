"""Which answer a MATH completion gives, and the normal form of an answer's text, before math-verify reads it.

Standard library only: lm-eval loads the task's ``utils.py`` by its path, and ``utils.py`` loads this file next to
it. The rule, documented in docs/howto/evaluation.md ("MATH-500 answer checking"):

Extraction (`final_answer`)

1. The answer part: the last ``<answer>...</answer>`` block (or the text after a final unclosed ``<answer>``),
   else the whole completion.
2. In it, the last boxed answer: ``\\boxed{...}``, ``\\fbox{...}`` or ``\\boxed X``. Boxes with nothing but a
   separator between them (a comma, a semicolon, "and", "or", spacing, math delimiters, a variable's ``x =``) are one
   list answer (``$x = \\boxed{-2}$ or $x = \\boxed{1}$``); any other text between two boxes means the later box
   replaces the earlier one (a model correcting itself: ``\\boxed{3} ... wrong ... \\boxed{5}`` answers 5, not
   {3, 5}).
3. No box: the answer part itself (math-verify then finds the final answer in the prose).

Normal form (`normalize`), applied to the gold answer and to the extracted answer alike

* Thousands separators (``,`` ``{,}`` ``\\,`` ``\\thinspace`` ``\\ `` a space, a thin or no-break space) are
  removed where they separate thousands: a first group of 1-3 digits (not starting with 0) then groups of exactly 3
  digits, with one separator kind throughout. A plain comma counts only when the answer has no other comma and is
  not bracketed (``(1,234)`` stays a pair). Anywhere else a separator is left alone.
* A trailing period is dropped (``5.`` is 5).
* A repeating decimal ``0.1\\overline{6}`` becomes its exact fraction (``\\frac{1}{6}``).
* A mixed number ``2\\frac{1}{4}`` (a whole number, then a proper numeric fraction) is the number 9/4, not 2 * 1/4.
* Scientific notation (``3.2e4``, ``3.2E-4``, ``3.2\\times 10^{4}``, ``3.2 \\cdot 10^4``) becomes the exact decimal
  (``32000``, ``0.00032``): the parser would read ``3.2e4`` as 3.2 * e * 4, and ``6.02\\times10^{23}`` as an inexact
  float.
* Percentages: a percent sign (``\\%``, ``%``, ``\\text{%}``, "percent") marks the unit and is dropped, so ``X\\%``
  and ``X`` are the same answer and ``X\\%`` is never read as ``X/100`` (MATH's golds give "what percent" answers
  as the number, with or without the sign).
* Spacing between two digits that is not a thousands separator (``1\\,23``, ``2 3``) makes a boxed or bare answer
  no answer: the parser would read it as a sum.

Text answers (`text_answer`): a gold written as text (``\\text{Monday}``, ``\\text{(C)}``) is compared as text, case
and spacing aside, with or without ``\\text{}`` and with a single-letter choice's parentheses optional.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import List, Optional, Tuple

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_BOX = re.compile(r"\\(?:boxed|fbox)(?:\s*(\{)|\s+(?=[^\s{$]))")
# what may stand between two boxes of one list answer: spacing, math delimiters, a separator, a variable's "x ="
_LIST_GAP = re.compile(
    r"(?:\s|\$|\\[()\[\]]|\\q?quad|\\[,;:! ]|[,;]|\band\b|\bor\b|\\text\{\s*(?:and|or)\s*\}"
    r"|[A-Za-z](?:_\{?\w+\}?)?\s*=)*",
    re.I,
)
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))

# ------------------------------------------------------------------------------------------------- extraction


def answer_part(completion: str) -> str:
    """The last ``<answer>...</answer>`` block's text (or what follows a final unclosed ``<answer>``), else the
    whole completion."""
    blocks = _ANSWER_TAG.findall(completion)
    if blocks:
        return blocks[-1].strip()
    i = completion.rfind("<answer>")
    return completion[i + len("<answer>"):].strip() if i >= 0 else completion


def boxes(text: str) -> List[Tuple[int, int, str]]:
    """Every ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed X`` in ``text``: ``(start, end, content)``, in order. An
    unclosed box's content runs to the end of the text."""
    found = []
    pos = 0
    while True:
        m = _BOX.search(text, pos)
        if m is None:
            return found
        if m.group(1) is None:  # \boxed 5: up to the next space or math delimiter
            word = re.match(r"[^\s$]+", text[m.end():])
            found.append((m.start(), m.end() + word.end(), word.group(0)))
            pos = m.end() + word.end()
            continue
        end = _closing_brace(text, m.end() - 1)
        found.append((m.start(), len(text) if end is None else end + 1, text[m.end():end].strip()))
        if end is None:
            return found
        pos = end + 1


def _closing_brace(text: str, open_at: int) -> Optional[int]:
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed(text: str) -> Optional[str]:
    """The last boxed answer of ``text`` (a list answer joined with commas when several boxes stand side by side
    with only a separator between them), or None when there is no box."""
    found = boxes(text)
    if not found:
        return None
    group = [found[-1]]
    for earlier in reversed(found[:-1]):
        if _LIST_GAP.fullmatch(text[earlier[1]:group[0][0]]) is None:
            break
        group.insert(0, earlier)
    return ", ".join(content for _, _, content in group)


def final_answer(completion: str) -> Tuple[str, bool]:
    """``(answer text, boxed)``: the last boxed answer of the answer part (``boxed`` True), else the answer part
    itself (False). See the module doc for the rule."""
    part = answer_part(completion)
    boxed = last_boxed(part)
    return (boxed, True) if boxed is not None else (part, False)


# ------------------------------------------------------------------------------------------------- normal form

_SEPARATORS = (r"\{,\}", r"\\,", r"\\thinspace\s*", r"\\ ", " ", "\u2009", "\u202f", "\u00a0", ",")
_OVERLINE = re.compile(r"(-?)(\d*)\.(\d*)\\overline\s*(?:\{(\d+)\}|(\d))")
_SCIENTIFIC = re.compile(
    r"(?<![\w\\.^])(-?)(\d+(?:\.\d*)?|\.\d+)"
    r"(?:[eE]([+-]?\d+)(?![\w.])|\s*\\(?:times|cdot)\s*10\s*\^\s*(?:\{\s*([+-]?\d+)\s*\}|(\d)))"
)
_PERCENT = re.compile(r"(?<=[\d}.])\s*(?:\\%|%|\\text\{\s*\\?%\s*\}|\\(?:text|mbox)\{\s*percent\s*\}|\s*percent\b)")
_MIXED = re.compile(r"(?<![\w.}^_\\])(-?)(\d+)\s*\\[dt]?frac\s*\{(\d+)\}\s*\{(\d+)\}")
_BRACKETED = re.compile(r"^\s*(?:\\left\s*)?(?:\(|\[|\\\{)")


def _thousands_run(sep: str) -> re.Pattern:
    return re.compile(rf"(?<![\d.,]){_NUMBER_START}(?:{sep}\d{{3}})+(?![\d])")


_NUMBER_START = r"[1-9]\d{0,2}"
_RUNS = {sep: _thousands_run(sep) for sep in _SEPARATORS}


def strip_thousands(text: str, plain: bool = True) -> str:
    """``text`` with its thousands separators removed (see the module doc). ``plain`` False (prose): only the
    separators that cannot separate list items or words (``{,}``, ``\\,``, ``\\thinspace``, ``\\ ``, thin and
    no-break spaces), not a plain comma or space."""
    for sep, run in _RUNS.items():
        if sep in (",", " ") and not plain:
            continue
        if sep == ",":
            outside = run.sub("", text)
            if "," in outside or _BRACKETED.match(text):
                continue
        text = run.sub(lambda m: re.sub(sep, "", m.group(0)), text)
    return text


def _repeating(m: re.Match) -> str:
    sign, whole, fixed, cycle = m.group(1), m.group(2) or "0", m.group(3), m.group(4) or m.group(5)
    value = Fraction(int(whole + fixed + cycle) - int(whole + fixed), 10 ** len(fixed) * (10 ** len(cycle) - 1))
    return rf"{sign}\frac{{{value.numerator}}}{{{value.denominator}}}" if value.denominator != 1 else \
        f"{sign}{value.numerator}"


def _mixed(m: re.Match) -> str:
    sign, whole, num, den = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
    if not 0 < num < den:  # a mixed number's fraction is proper; anything else is left as written
        return m.group(0)
    return rf"{sign}\frac{{{whole * den + num}}}{{{den}}}"


def _scientific(m: re.Match) -> str:
    try:
        value = Decimal(f"{m.group(2)}e{m.group(3) or m.group(4) or m.group(5)}")
    except InvalidOperation:
        return m.group(0)
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return m.group(1) + text


def strip_delimiters(text: str) -> str:
    """``text`` without math delimiters wrapping all of it (``$...$``, ``\\(...\\)``, ``\\[...\\]``)."""
    text = text.strip()
    changed = True
    while changed:
        changed = False
        for left, right in _DELIMITERS:
            if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
                text, changed = text[len(left):-len(right)].strip(), True
    return text


def drop_trailing_period(text: str) -> str:
    """``5.`` -> ``5``; an ellipsis (``...``) stays."""
    text = text.rstrip()
    while text.endswith("\\.") or (text.endswith(".") and not text.endswith("..")):
        text = text[:-2] if text.endswith("\\.") else text[:-1]
        text = strip_delimiters(text.rstrip())
    return text


_SPACED_DIGITS = re.compile(r"\d(?:\s|~|\\[,;: ]|\\thinspace|[\u2009\u202f\u00a0])+\d")


def spaced_digits(text: str) -> bool:
    """Whether spacing stands between two digits in ``text`` (normal form: thousands separators already gone). The
    parser would read ``1\\,23`` or ``2 3`` as a sum (24, 5); such an answer is read as no answer instead."""
    return _SPACED_DIGITS.search(text) is not None


def normalize(text: str, *, whole_answer: bool = True) -> str:
    """The normal form of an answer's text (module doc). ``whole_answer`` False for prose (a completion without a
    boxed answer): the same rewrites inside it, but no delimiter or trailing-period stripping of the whole."""
    text = text.replace("\\!", "")
    if whole_answer:
        text = drop_trailing_period(strip_delimiters(text))
    text = strip_thousands(text, plain=whole_answer)
    text = _OVERLINE.sub(_repeating, text)
    text = _MIXED.sub(_mixed, text)
    text = _SCIENTIFIC.sub(_scientific, text)
    return _PERCENT.sub("", text)


# ------------------------------------------------------------------------------------------------- text answers

_TEXT_WRAP = re.compile(r"\\(?:text(?:bf|it|rm|normal|sf|tt)?|mathrm|mbox|textup)\s*\{([^{}]*)\}")
_WRAPPED_ONLY = re.compile(rf"(?:{_TEXT_WRAP.pattern}|[\s,;()]|\band\b|\bor\b)+")
_WORDS = re.compile(r"[A-Za-z][A-Za-z'\- ]*")
_ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+?)(?:\.\s|\.?$|\n)", re.I)


def text_answer(gold: str) -> Optional[str]:
    """The canonical text of a gold written as text (all of it inside ``\\text{}``-like wrappers, with at least one
    letter: ``\\text{Monday}``, ``\\text{(C)}``, ``\\text{east}``), else None (a mathematical gold)."""
    body = strip_delimiters(gold)
    if not body or _WRAPPED_ONLY.fullmatch(body) is None or not _TEXT_WRAP.search(body):
        return None
    canonical = canonical_text(body)
    return canonical if re.search(r"[a-z]", canonical) else None


def canonical_text(text: str) -> str:
    """Case-folded words with ``\\text{}``-like wrappers, math delimiters, spacing commands, a trailing period and a
    single letter's parentheses removed: ``\\text{(C)}`` -> ``c``, ``\\textbf{ East }.`` -> ``east``."""
    text = drop_trailing_period(strip_delimiters(text))
    for _ in range(3):
        text = _TEXT_WRAP.sub(r"\1", text)
    text = re.sub(r"\\[,;:! ]|~|\$|\\\(|\\\)", " ", text)
    text = re.sub(r"\(\s*([A-Za-z])\s*\)", r"\1", text)
    text = re.sub(r"\s*,\s*", ", ", text)
    return re.sub(r"\s+", " ", drop_trailing_period(text)).strip().lower()


def text_in_prose(text: str) -> Optional[str]:
    """A text answer given in prose without a box: the last "answer is X" / "Answer: X" phrase's X, else the whole
    text when it is a few words (at most 4) and nothing else."""
    phrases = _ANSWER_PHRASE.findall(text)
    if phrases:
        return phrases[-1]
    short = strip_delimiters(text)
    return short if _WORDS.fullmatch(short.strip().rstrip(".")) and len(short.split()) <= 4 else None
