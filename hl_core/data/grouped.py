"""Grouped (offline GRPO) data: scored completion groups, loading, tokenization and collation.

Rows (detected per row):

* native: ``{"prompt": str | messages, "completions": [str, ...], "scores": [number, ...]}`` (same length,
  at least 2 completions);
* UltraFeedback-ArmoRM style (``princeton-nlp/llama3-ultrafeedback-armorm``, ``.../gemma2-...``):
  ``chosen``/``rejected`` message lists plus ``all_rm_scores`` -> a group of TWO, chosen scored
  ``max(all_rm_scores)``, rejected ``min(all_rm_scores)`` (what the humanline authors' GRPO did; the
  other ``all_generated_responses`` are not used);
* pairs with ``score_chosen``/``score_rejected`` -> a group of two with those scores;
* plain pairs without scores -> a group of two scored (1.0, 0.0).

Pairs are parsed by `hl_core.data.preference.parse_preference_row` (plain or messages form;
``format`` has its meaning there; native groups accept both prompt forms and string completions).
Bad rows raise `hl_core.errors.DataError` naming ``file:line`` (or ``file:row N``) and the fix;
rows are never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List

import torch

from hl_core.data.preference import parse_preference_row
from hl_core.data.rows import (
    absent,
    check_score,
    fields_present,
    has,
    missing_prompt_error,
    parse_prompt,
    require_completion,
    row_loader,
    type_name,
)
from hl_core.data.tokens import pad_right, tokenize_prompt_and_completions
from hl_core.errors import DataError

GROUP_EXAMPLE = '{"prompt": "...", "completions": ["...", "..."], "scores": [1.0, 0.0]}'
NATIVE_NEEDS = "GRPO group rows need `prompt`, `completions` and `scores`"
NATIVE_FIELDS = ("completions", "scores")
PAIR_FIELDS = ("chosen", "rejected")


@dataclass
class GroupRecord:
    """One prompt with >= 2 scored completions. ``prompt`` is the conversation before the completions."""

    prompt: List[Dict[str, str]]
    completions: List[str]
    scores: List[float]
    source: str  # "file.jsonl:12" / "file.parquet:row 3" / "hf:name[split]:row 3"


# --------------------------------------------------------------------------------------------- loading


def parse_group_row(row: Any, source: str, format: str = "auto") -> GroupRecord:
    """Validate one row (native group or pair) and turn it into a `GroupRecord`."""
    if not isinstance(row, dict):
        raise DataError(
            f"{source}: row is a {type(row).__name__}, not an object. Fix: each row must be an object with "
            f"`prompt`, `completions` and `scores` fields (or a scored preference pair)."
        )
    native = any(has(row, f) for f in NATIVE_FIELDS)
    paired = any(has(row, f) for f in PAIR_FIELDS)
    if native and paired:
        raise DataError(
            f"{source}: row has both group fields (`completions`/`scores`) and preference-pair fields "
            f"(`chosen`/`rejected`), so its meaning is ambiguous. Fix: keep one form per row."
        )
    if paired:
        return _parse_pair(row, source, format)
    if not native:
        raise DataError(
            f"{source}: row is neither a GRPO group nor a preference pair (fields present: {fields_present(row)}). "
            f"Fix: give every row `prompt`, `completions` (a list of strings) and `scores` (a list of numbers), "
            f"or `chosen`/`rejected` (optionally with `all_rm_scores` or `score_chosen`/`score_rejected`)."
        )
    return _parse_native(row, source)


load_group_records = row_loader(
    "load_group_records", parse_group_row, "GRPO group data", GROUP_EXAMPLE,
    "`prompt`, `completions` and `scores` (or scored preference pairs)",
    """Load and validate GRPO groups (`GroupRecord`) from a local file or a Hugging Face set; ``limit``
    counts rows (= groups).""",
)


def _group_too_small(source: str, n: int) -> DataError:
    return DataError(
        f"{source}: GRPO groups of size {n}: the row has {n} completion{'s' if n != 1 else ''}, but GRPO needs at "
        f"least 2 per prompt -- the advantage (score - group mean) / group std would be 0 for every token, so "
        f"the row would train nothing. Fix: give each prompt 2 or more scored completions (e.g. sample more "
        f"generations, or use the chosen/rejected pair as a group of two), or remove the row."
    )


def _parse_native(row: Dict[str, Any], source: str) -> GroupRecord:
    for field in NATIVE_FIELDS:
        if not has(row, field):
            raise DataError(
                f"{source}: {absent(row, field)} (fields with values: {fields_present(row)}). Fix: give every "
                f"GRPO row `prompt`, `completions` (a list of strings) and `scores` (one number per completion)."
            )
    if not has(row, "prompt"):
        raise missing_prompt_error(source, NATIVE_NEEDS, row=row)
    completions, scores = row["completions"], row["scores"]
    for field, value in (("completions", completions), ("scores", scores)):
        if not isinstance(value, (list, tuple)):
            what = "strings" if field == "completions" else "numbers"
            raise DataError(
                f"{source}: field `{field}` is a {type_name(value)}, expected a list of {what}. Fix: store "
                f"`{field}` as a JSON list with one entry per completion."
            )
    if len(completions) != len(scores):
        raise DataError(
            f"{source}: `completions` has {len(completions)} entries but `scores` has {len(scores)}. Fix: give "
            f"exactly one score per completion, in the same order."
        )
    if len(completions) < 2:
        raise _group_too_small(source, len(completions))
    texts = [require_completion(c, f"completions[{i}]", source, "a GRPO group") for i, c in enumerate(completions)]
    values = [check_score(s, f"scores[{i}]", source) for i, s in enumerate(scores)]
    prompt = parse_prompt(row["prompt"], source, NATIVE_NEEDS)
    return GroupRecord(prompt=prompt, completions=texts, scores=values, source=source)


def _parse_pair(row: Dict[str, Any], source: str, format: str) -> GroupRecord:
    pair = parse_preference_row(row, source, format)
    if has(row, "all_rm_scores"):
        raw = row["all_rm_scores"]
        if not isinstance(raw, (list, tuple)) or not raw:
            got = "an empty list" if isinstance(raw, (list, tuple)) else f"a {type_name(raw)}"
            raise DataError(
                f"{source}: field `all_rm_scores` is {got}, expected the list of reward-model scores of the "
                f"generated responses. Fix: store `all_rm_scores` as a non-empty list of numbers, or drop the column "
                f"(pairs without scores become groups scored 1.0 / 0.0)."
            )
        values = [check_score(s, f"all_rm_scores[{i}]", source) for i, s in enumerate(raw)]
        scores = [max(values), min(values)]
    elif has(row, "score_chosen") or has(row, "score_rejected"):
        for field in ("score_chosen", "score_rejected"):
            if not has(row, field):
                raise DataError(
                    f"{source}: row has {'score_rejected' if field == 'score_chosen' else 'score_chosen'} but no "
                    f"`{field}`. Fix: give both `score_chosen` and `score_rejected`, or neither (scores 1.0 / 0.0)."
                )
        scores = [check_score(row["score_chosen"], "score_chosen", source),
                  check_score(row["score_rejected"], "score_rejected", source)]
    else:
        scores = [1.0, 0.0]
    return GroupRecord(prompt=pair.prompt, completions=[pair.chosen, pair.rejected], scores=scores, source=source)


# --------------------------------------------------------------------------------------------- tokenizing


def tokenize_group(
    record: GroupRecord,
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    chat_template: str = "auto",
) -> Dict[str, Any]:
    """Tokenize one group into ``{"input_ids": [[...]], "completion_mask": [[...]], "scores": [...]}``.

    As `hl_core.data.preference.tokenize_preference`, with one prompt shared by the whole group:
    the LONGEST completion decides whether the prompt is cut to its last ``max_prompt_length`` tokens
    (BOS kept); every completion is then cut to ``max_length - len(prompt) - 1`` tokens and gets EOS, so
    each sequence fits in ``max_length`` and all start with the same prompt ids.
    """
    prompt_ids, completions = tokenize_prompt_and_completions(
        record.prompt, record.completions, tokenizer, max_length, max_prompt_length, chat_template
    )
    return {
        "input_ids": [prompt_ids + c for c in completions],
        "completion_mask": [[0] * len(prompt_ids) + [1] * len(c) for c in completions],
        "scores": [float(s) for s in record.scores],
    }


def identical_group(feature: Dict[str, Any]) -> bool:
    """Every completion is the same tokens: the advantages sum to zero on one sequence, so no signal."""
    first = feature["input_ids"][0]
    return all(ids == first for ids in feature["input_ids"][1:])


# --------------------------------------------------------------------------------------------- collating


def collate_groups(features: List[Dict[str, Any]], pad_token_id: int) -> Dict[str, "torch.Tensor"]:
    """Right-pad all completions of a batch of groups, group-major, into ``[N, T]`` tensors.

    Returns long ``input_ids`` / ``attention_mask`` / ``completion_mask`` ``[N, T]`` (N = total number of
    completions; the rows of group 0 first, in their order, then group 1, ...), float32 ``scores`` ``[N]``
    and long ``group_ids`` ``[N]`` (the index of the row's group in this batch, 0..num_groups-1).
    """
    if not features:
        raise ValueError("collate_groups needs at least one feature")
    seqs, masks, scores, group_ids = [], [], [], []
    for g, f in enumerate(features):
        if not (len(f["input_ids"]) == len(f["completion_mask"]) == len(f["scores"])):
            raise ValueError(
                f"group {g}: {len(f['input_ids'])} sequences, {len(f['completion_mask'])} masks and "
                f"{len(f['scores'])} scores"
            )
        seqs.extend(f["input_ids"])
        masks.extend(f["completion_mask"])
        scores.extend(float(s) for s in f["scores"])
        group_ids.extend([g] * len(f["scores"]))
    out = pad_right(seqs, masks, pad_token_id)
    out["scores"] = torch.tensor(scores, dtype=torch.float32)
    out["group_ids"] = torch.tensor(group_ids, dtype=torch.long)
    return out


__all__ = [
    "GroupRecord",
    "load_group_records",
    "parse_group_row",
    "tokenize_group",
    "collate_groups",
]
