"""Pairwise preference data: loading, validation, tokenization, truncation and collation.

Rows come in two forms (``format="auto"`` detects the form per row from the type of ``chosen``):

* plain:    ``{"prompt": str, "chosen": str, "rejected": str}``
* messages: ``{"chosen": [{"role", "content"}, ...], "rejected": [...], "prompt": str (optional)}`` as in
  UltraFeedback-style sets (e.g. ``princeton-nlp/llama3-ultrafeedback-armorm``): each list is the whole
  conversation, its final assistant message is the completion and the messages before it are the prompt
  (chosen and rejected must share them). When the lists hold only the assistant message, the ``prompt``
  column is the prompt (a string, or a list of messages as in TRL's conversational format).

Every bad row raises `hl_core.errors.DataError` naming its place -- ``file.jsonl:LINE`` (1-based
line) for JSONL, ``file:row N`` (0-based row index) for JSON lists, Parquet files and Hugging Face sets --
and the fix. Rows are never silently dropped.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from hl_core.data.rows import (
    PAIR_EXAMPLE,
    absent,
    check_conversation,
    check_messages as _check_messages,
    check_prompt_text,
    fields_present,
    missing_prompt_error,
    parse_prompt,
    require_completion as _require_completion,
    row_loader,
    type_name as _type_name,
)
from hl_core.data.tokens import pad_right, prompt_text, tokenize_prompt_and_completions, truncate_completions
from hl_core.errors import DataError, RecipeError

if TYPE_CHECKING:  # the annotation only: collating goes through tokens.pad_right
    import torch

PLAIN_NEEDS = "plain form needs `prompt`, `chosen` and `rejected` strings"


@dataclass
class PreferenceRecord:
    """One preference pair. ``prompt`` is the conversation before the completion (chat messages)."""

    prompt: List[Dict[str, str]]
    chosen: str
    rejected: str
    source: str  # "file.jsonl:12" / "file.parquet:row 3" / "hf:name[split]:row 3", for error messages


# --------------------------------------------------------------------------------------------- rows and loading


def parse_preference_row(row: Any, source: str, format: str = "auto") -> PreferenceRecord:
    """Validate one row (plain or messages form) and turn it into a `PreferenceRecord`."""
    if not isinstance(row, dict):
        raise DataError(
            f"{source}: row is a {type(row).__name__}, not an object. Fix: each row must be an object with "
            f"`prompt`, `chosen` and `rejected` fields."
        )
    for field in ("chosen", "rejected"):
        if row.get(field) is None:
            raise DataError(
                f"{source}: {absent(row, field)} (fields with values: {fields_present(row)}). "
                f"Fix: give every row `prompt`, `chosen` and `rejected` (strings), or `chosen`/`rejected` "
                f"conversations (lists of {{role, content}} messages)."
            )
    chosen = row["chosen"]
    if format == "auto":
        if isinstance(chosen, str):
            fmt = "plain"
        elif isinstance(chosen, (list, tuple)):
            fmt = "messages"
        else:
            raise DataError(
                f"{source}: field `chosen` is a {_type_name(chosen)}; expected a string (plain form) or a list of "
                f"{{role, content}} messages (messages form). Fix: store the completion text as a string."
            )
    else:
        fmt = format
    if fmt == "plain":
        return _parse_plain(row, source)
    return _parse_messages(row, source)


load_preference_records = row_loader(
    "load_preference_records", parse_preference_row, "preference data", PAIR_EXAMPLE,
    "`prompt`, `chosen` and `rejected`",
    """Load and validate preference pairs (`PreferenceRecord`) from a local file or a Hugging Face set.""",
)


def _parse_plain(row: Dict[str, Any], source: str) -> PreferenceRecord:
    if row.get("prompt") is None:
        raise missing_prompt_error(source, PLAIN_NEEDS, row=row)
    chosen = _require_completion(row["chosen"], "chosen", source, "plain form")
    rejected = _require_completion(row["rejected"], "rejected", source, "plain form")
    messages = parse_prompt(row["prompt"], source, PLAIN_NEEDS)
    return PreferenceRecord(prompt=messages, chosen=chosen, rejected=rejected, source=source)


def _parse_messages(row: Dict[str, Any], source: str) -> PreferenceRecord:
    convs = {field: check_conversation(row[field], field, source) for field in ("chosen", "rejected")}
    chosen_prefix, rejected_prefix = convs["chosen"][:-1], convs["rejected"][:-1]
    if chosen_prefix != rejected_prefix:
        raise DataError(
            f"{source}: `chosen` and `rejected` conversations differ before their final assistant message "
            f"({len(chosen_prefix)} vs {len(rejected_prefix)} prompt messages), so they do not answer the same "
            f"prompt. Fix: make both conversations share the same messages before the completion."
        )
    prompt: List[Dict[str, str]] = chosen_prefix
    if not prompt:
        raw = row.get("prompt")
        if isinstance(raw, str):
            prompt = [{"role": "user", "content": raw}]
        elif isinstance(raw, (list, tuple)) and raw:
            prompt = _check_messages(raw, "prompt", source)
        else:
            raise DataError(
                f"{source}: messages-form row has no prompt: `chosen` holds only the assistant message and there "
                f"is no `prompt` field. Fix: include the user message(s) before the assistant message in `chosen` "
                f"and `rejected`, or add a `prompt` string."
            )
    check_prompt_text(prompt, source)
    chosen = _require_completion(convs["chosen"][-1]["content"], "chosen", source, "messages form")
    rejected = _require_completion(convs["rejected"][-1]["content"], "rejected", source, "messages form")
    return PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected, source=source)


# --------------------------------------------------------------------------------------------- splitting


def split_eval(records: Sequence[PreferenceRecord], eval_fraction: float, seed: int) -> Tuple[list, list]:
    """Deterministically hold out ``round(len * eval_fraction)`` records (at least 1 when the fraction is > 0).

    The held-out indices are drawn with ``random.Random(seed)``; both parts keep the input order.
    """
    if not (0.0 <= float(eval_fraction) < 1.0):
        raise RecipeError(f"eval_fraction must be in [0, 1), got {eval_fraction!r}; fix the eval fraction.")
    n = len(records)
    if eval_fraction == 0 or n == 0:
        return list(records), []
    n_eval = max(1, int(round(n * eval_fraction)))
    if n_eval >= n:
        raise RecipeError(
            f"eval_fraction {eval_fraction} of {n} records leaves no training records; lower the eval fraction or "
            f"give more data."
        )
    held = set(random.Random(seed).sample(range(n), n_eval))
    train = [r for i, r in enumerate(records) if i not in held]
    eval_ = [r for i, r in enumerate(records) if i in held]
    return train, eval_


# --------------------------------------------------------------------------------------------- tokenizing


def truncate_pair(
    prompt_ids: List[int],
    chosen_ids: List[int],
    rejected_ids: List[int],
    max_length: int,
    max_prompt_length: int,
    bos_token_id: Optional[int] = None,
) -> Tuple[List[int], List[int], List[int]]:
    """Truncate one pair; completions here EXCLUDE the EOS that is appended afterwards.

    With ``L = len(prompt) + 1 + len(longer completion)`` (the 1 is the EOS):

    1. if ``L > max_length`` and ``len(prompt) > max_prompt_length``: keep the END of the prompt, i.e. its
       last ``max_prompt_length`` tokens (when the prompt starts with ``bos_token_id``, BOS is kept and
       followed by the last ``max_prompt_length - 1`` tokens);
    2. then each completion longer than ``max_length - len(prompt) - 1`` is cut to that many tokens (its
       start is kept), so every sequence, EOS included, fits in ``max_length``.
    """
    prompt_ids, (chosen_ids, rejected_ids) = truncate_completions(
        prompt_ids, [chosen_ids, rejected_ids], max_length, max_prompt_length, bos_token_id
    )
    return prompt_ids, chosen_ids, rejected_ids


def tokenize_preference(
    record: PreferenceRecord,
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    chat_template: str = "auto",
) -> Dict[str, List[int]]:
    """Tokenize one pair into ``{chosen,rejected}_{input_ids,completion_mask}`` (plain lists).

    Prompt text: ``tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)``
    (``chat_template="auto"`` with a template), else the contents joined by ``"\\n\\n"`` plus ``"\\n\\n"``
    (``"none"``, or ``"auto"`` without a template). Prompt and completion are tokenized SEPARATELY with
    ``add_special_tokens=False`` so the boundary is exact; BOS is prepended to the prompt only when the
    tokenizer normally adds one and the rendered prompt does not already start with it; EOS is appended to
    each completion. ``completion_mask`` is 1 exactly on the completion tokens and that EOS.

    Truncation (see `truncate_pair`): if prompt + longer completion + EOS exceeds ``max_length`` and
    the prompt is longer than ``max_prompt_length``, keep the prompt's last ``max_prompt_length`` tokens
    (BOS kept); then cut each completion to ``max_length - len(prompt) - 1`` tokens and append EOS.

    Relation to HALOs (ContextualAI/HALOs ``train/dataloader.py``, ``DataLoader.tokenize_batch_element``
    in its pre-chat-template versions): same rule -- prompt truncated first, only when the combined length
    exceeds ``max_length`` and the prompt exceeds ``max_prompt_length``, keeping its end
    (``truncation_mode="keep_end"``, HALOs' default) to ``max_prompt_length`` tokens, then the generation
    cut to ``max_length - len(prompt)``. Differences: (a) HALOs decides per sequence, so chosen and rejected
    can end up with different prompts; here the longer completion decides once per pair so both share one
    prompt; (b) HALOs appends EOS after cutting (sequences can reach ``max_length + 1``) and decodes /
    re-tokenizes the text; here EOS counts toward ``max_length`` and token ids are cut directly; (c) BOS is
    kept at the front of a truncated prompt. (Newer HALOs versions truncate message contents turn by turn
    inside the chat template, keeping the START of the conversation, and always cap the prompt at
    ``max_prompt_length``; that is not what is implemented here.)
    """
    prompt_ids, (chosen_ids, rejected_ids) = tokenize_prompt_and_completions(
        record.prompt, [record.chosen, record.rejected], tokenizer, max_length, max_prompt_length, chat_template
    )
    out: Dict[str, List[int]] = {}
    for key, comp in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        out[f"{key}_input_ids"] = prompt_ids + comp
        out[f"{key}_completion_mask"] = [0] * len(prompt_ids) + [1] * len(comp)
    return out


def identical_pair(feature: Dict[str, List[int]]) -> bool:
    """Chosen and rejected are the same tokens (no preference signal: e.g. both cut to the same prefix)."""
    return feature["chosen_input_ids"] == feature["rejected_input_ids"]


# --------------------------------------------------------------------------------------------- collating


def collate_preference(features: List[Dict[str, List[int]]], pad_token_id: int) -> Dict[str, "torch.Tensor"]:
    """Right-pad a batch of B tokenized pairs into ``[2B, T]`` tensors (rows 0..B-1 chosen, B..2B-1 rejected).

    Returns ``input_ids`` (long, padded with ``pad_token_id``), ``attention_mask`` (long, 1 on real tokens)
    and ``completion_mask`` (long 0/1); T is the longest sequence in the batch.
    """
    if not features:
        raise ValueError("collate_preference needs at least one feature")
    seqs = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
    masks = [f["chosen_completion_mask"] for f in features] + [f["rejected_completion_mask"] for f in features]
    return pad_right(seqs, masks, pad_token_id)


__all__ = [
    "PreferenceRecord",
    "load_preference_records",
    "parse_preference_row",
    "split_eval",
    "prompt_text",
    "truncate_pair",
    "tokenize_preference",
    "collate_preference",
]
