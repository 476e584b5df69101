"""Prompt-only records for rollouts (online / sparse training): the policy writes the completions.

Accepted rows: ``prompt`` (a string or a message list) or ``problem`` (MATH-style), plus an optional
reference answer for verifiable rewards: ``answer`` (string or number), or ``solution`` whose last
``\\boxed{...}`` is taken as the answer (the MATH convention, e.g. ``simplescaling/openaimath``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from hl_core.errors import DataError

from .rows import fields_present, parse_prompt, row_loader, type_name
from .tokens import encode_prompt, note_truncation, prompt_text

PROMPT_EXAMPLE = '{"prompt": "What is 12+7?", "answer": "19"}'


@dataclass
class PromptRecord:
    prompt: List[dict]  # chat messages the policy answers
    reference: Optional[str]  # reference answer for verifiable rewards (None when not given)
    source: str


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if absent."""
    for marker in ("\\boxed", "\\fbox"):
        start = text.rfind(marker)
        if start < 0:
            continue
        i = text.find("{", start)
        if i < 0:
            continue
        depth, j = 0, i
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j]
            j += 1
    return None


def parse_prompt_row(
    row: Any, source: str, format: str = "auto", system_prompt: Optional[str] = None
) -> PromptRecord:
    """Validate one prompt row (``format`` is not used: prompts may be strings or message lists)."""
    if not isinstance(row, dict):
        raise DataError(f"{source}: row is a {type_name(row)}, expected an object like {PROMPT_EXAMPLE}.")
    field = "prompt" if row.get("prompt") is not None else "problem"
    needs = "rollouts need `prompt` (or MATH-style `problem`) and, for verifiable rewards, `answer` or `solution`"
    if row.get(field) is None:
        raise DataError(
            f"{source}: row has neither `prompt` nor `problem` (fields present: {fields_present(row)}). Fix: {needs}."
        )
    messages = parse_prompt(row[field], source, needs, field)
    if system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    reference = None
    if row.get("answer") is not None:
        answer = row["answer"]
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise DataError(f"{source}: `answer` is a {type_name(answer)}, expected a string or a number.")
        reference = str(answer)
    elif isinstance(row.get("solution"), str):
        reference = last_boxed(row["solution"])
        if reference is None:
            raise DataError(
                f"{source}: `solution` has no \\boxed{{...}} answer. Fix: add an `answer` field, or box the final "
                f"answer."
            )
    return PromptRecord(messages, reference, source)


load_prompt_records = row_loader(
    "load_prompt_records", parse_prompt_row, "prompt data", PROMPT_EXAMPLE, "`prompt` (or `problem`) and `answer`",
    """Load prompts and reference answers (`PromptRecord`) from a local file or a Hugging Face set;
    ``system_prompt`` (keyword) is put first in every conversation that has no system message.""",
)


def tokenize_prompt(
    record: PromptRecord, tokenizer, max_length: int, max_prompt_length: int, chat_template: str = "auto"
) -> dict:
    """``{"prompt_ids", "reference", "messages", "source"}``; long prompts keep their last tokens (and BOS).
    ``max_length`` is unused here: generated completions are capped by ``rollout.max_new_tokens``."""
    text = prompt_text(record.prompt, tokenizer, chat_template)
    ids = encode_prompt(text, tokenizer)
    if len(ids) > max_prompt_length:
        note_truncation(len(ids) - max_prompt_length)
        bos = tokenizer.bos_token_id
        keep_bos = bos is not None and ids[0] == bos
        ids = ([bos] if keep_bos else []) + ids[len(ids) - max_prompt_length + (1 if keep_bos else 0) :]
    return {"prompt_ids": ids, "reference": record.reference, "messages": record.prompt, "source": record.source}
