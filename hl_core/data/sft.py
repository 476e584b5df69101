"""Demonstrations for supervised fine-tuning (warm-up): a prompt and the completion to imitate.

Rows: ``prompt`` (string or message list; MATH-style ``problem`` also accepted) and ``completion``
(string; ``answer`` also accepted, e.g. a toy task whose demonstration is just the answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

from hl_core.errors import DataError

from .rows import parse_prompt, require_completion, row_loader, type_name
from .tokens import pad_right, tokenize_prompt_and_completions

SFT_EXAMPLE = '{"prompt": "123+456=", "completion": "0579"}'
NEEDS = "SFT rows need `prompt` (or `problem`) and `completion` (or `answer`)"


@dataclass
class SFTRecord:
    prompt: List[Dict[str, str]]
    completion: str
    source: str


def parse_sft_row(row: Any, source: str, format: str = "auto") -> SFTRecord:
    if not isinstance(row, dict):
        raise DataError(f"{source}: row is a {type_name(row)}, expected an object like {SFT_EXAMPLE}.")
    prompt_field = "prompt" if row.get("prompt") is not None else "problem"
    prompt = parse_prompt(row.get(prompt_field), source, NEEDS, prompt_field)
    field = "completion" if row.get("completion") is not None else "answer"
    value = row.get(field)
    if value is None:
        raise DataError(f"{source}: row has no `completion` (or `answer`) field. Fix: {NEEDS}.")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    completion = require_completion(value, field, source, NEEDS)
    return SFTRecord(prompt, completion, source)


load_sft_records = row_loader(
    "load_sft_records", parse_sft_row, "SFT data", SFT_EXAMPLE, "`prompt` and `completion`",
    """Load and validate demonstrations (`SFTRecord`) from a local file or a Hugging Face set.""",
)


def tokenize_sft(record: SFTRecord, tokenizer, max_length: int, max_prompt_length: int,
                 chat_template: str = "auto") -> Dict[str, List[int]]:
    """``{"input_ids", "completion_mask"}``: prompt then completion + EOS; the mask marks the completion."""
    prompt_ids, (completion_ids,) = tokenize_prompt_and_completions(
        record.prompt, [record.completion], tokenizer, max_length, max_prompt_length, chat_template
    )
    return {"input_ids": prompt_ids + completion_ids,
            "completion_mask": [0] * len(prompt_ids) + [1] * len(completion_ids)}


def collate_sft(features: List[Dict[str, List[int]]], pad_token_id: int):
    return pad_right([f["input_ids"] for f in features], [f["completion_mask"] for f in features], pad_token_id)
