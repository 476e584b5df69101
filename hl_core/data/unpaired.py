"""Unpaired (KTO) data: labelled completions, loading, tokenization and collation with the KL batch.

Rows (``format="auto"`` detects the form per row):

* native: ``{"prompt": str | messages, "completion": str | messages, "label": bool}`` (TRL's KTO
  layout). ``label`` may also be the int 0 or 1; anything else is an error. A ``completion`` message list
  must end with the assistant message; messages before it, when there are any, are the prompt (the
  ``prompt`` column is then not needed), as for preference conversations.
* paired: anything `hl_core.data.preference.load_preference_records` accepts (``chosen`` /
  ``rejected``, plain or messages form). Each pair becomes TWO records, chosen (desirable) then rejected
  (undesirable), with the pair's source.

``format``: ``"auto"``; ``"plain"`` (string completions only) or ``"messages"`` (message-list completions
only) -- for paired rows it has the meaning of the preference loader. A row with neither
``completion``/``label`` nor ``chosen``/``rejected`` is an error (KTO needs labelled completions or
preference pairs), as is a row with both. Bad rows raise `hl_core.errors.DataError` naming
``file:line`` (or ``file:row N``); rows are never dropped.

Batches: `collate_unpaired` also builds KTO's reference-point batch of mismatched pairs,
each prompt with a completion written for a different prompt (`hl_core.objectives.kto.mismatched_pairs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from hl_core.data.preference import parse_preference_row
from hl_core.data.rows import (
    absent,
    check_conversation,
    check_prompt_text,
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
from hl_core.objectives.kto import mismatched_pairs

UNPAIRED_EXAMPLE = '{"prompt": "...", "completion": "...", "label": true}'
NATIVE_NEEDS = "KTO rows need `prompt`, `completion` and `label`"


@dataclass
class UnpairedRecord:
    """One labelled completion. ``prompt`` is the conversation before the completion (chat messages)."""

    prompt: List[Dict[str, str]]
    completion: str
    desirable: bool
    source: str  # "file.jsonl:12" / "file.parquet:row 3" / "hf:name[split]:row 3"


# --------------------------------------------------------------------------------------------- loading


def parse_unpaired_row(row: Any, source: str, format: str = "auto") -> List[UnpairedRecord]:
    """Validate one row; a native row gives one record, a preference pair two (chosen, then rejected)."""
    if not isinstance(row, dict):
        raise DataError(
            f"{source}: row is a {type(row).__name__}, not an object. Fix: each row must be an object with "
            f"`prompt`, `completion` and `label` fields (or `prompt`, `chosen` and `rejected`)."
        )
    native = has(row, "completion") or has(row, "label")
    paired = has(row, "chosen") or has(row, "rejected")
    if native and paired:
        raise DataError(
            f"{source}: row has both labelled-completion fields (`completion`/`label`) and preference-pair fields "
            f"(`chosen`/`rejected`), so its meaning is ambiguous. Fix: keep one form per row."
        )
    if paired:
        pair = parse_preference_row(row, source, format)
        return [
            UnpairedRecord(prompt=pair.prompt, completion=pair.chosen, desirable=True, source=source),
            UnpairedRecord(prompt=[dict(m) for m in pair.prompt], completion=pair.rejected, desirable=False,
                           source=source),
        ]
    if not native:
        raise DataError(
            f"{source}: row has no labels: KTO needs labelled completions (`prompt`, `completion`, `label` "
            f"true/false) or preference pairs (`prompt`, `chosen`, `rejected`), but the row has only "
            f"{fields_present(row)}. Fix: give every row a `completion` and a boolean `label`, or make the rows "
            f"preference pairs (`chosen`/`rejected`: each becomes one desirable and one undesirable example)."
        )
    return [_parse_native(row, source, format)]


load_unpaired_records = row_loader(
    "load_unpaired_records", parse_unpaired_row, "KTO data", UNPAIRED_EXAMPLE,
    "`prompt`, `completion` and `label` (or preference pairs with `chosen` and `rejected`)",
    """Load and validate KTO examples (`UnpairedRecord`) from a local file or a Hugging Face set.
    ``limit`` counts SOURCE rows: ``limit=3`` over pairs gives 6 records.""",
)


def _parse_label(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise DataError(
        f"{source}: field `label` is {'missing' if value is None else f'a {type_name(value)} ({value!r})'}; "
        f"expected true/false (or 1/0): true for a desirable completion, false for an undesirable one. "
        f"Fix: store `label` as a boolean."
    )


def _parse_native(row: Dict[str, Any], source: str, format: str) -> UnpairedRecord:
    if not has(row, "completion"):
        raise DataError(
            f"{source}: row has a `label` but its completion is missing ({absent(row, 'completion')}; fields with "
            f"values: {fields_present(row)}). "
            f"Fix: give every KTO row `prompt`, `completion` and `label`."
        )
    desirable = _parse_label(row.get("label"), source)
    value = row["completion"]
    if isinstance(value, str) and format != "messages":
        if not has(row, "prompt"):
            raise missing_prompt_error(source, NATIVE_NEEDS, row=row)
        completion = require_completion(value, "completion", source, "plain form")
        prompt = parse_prompt(row["prompt"], source, NATIVE_NEEDS)
    elif isinstance(value, (list, tuple)) and format != "plain":
        conv = check_conversation(value, "completion", source)
        prompt = conv[:-1]
        if not prompt:
            if not has(row, "prompt"):
                raise DataError(
                    f"{source}: row has no prompt: `completion` holds only the assistant message and there is "
                    f"no `prompt` field. Fix: add a `prompt` (a string or a list of messages)."
                )
            prompt = parse_prompt(row["prompt"], source, NATIVE_NEEDS)
        check_prompt_text(prompt, source)
        completion = require_completion(conv[-1]["content"], "completion", source, "messages form")
    else:
        form = {"plain": "a string (format `plain`)", "messages": "a list of messages (format `messages`)"}.get(
            format, "a string or a list of {role, content} messages"
        )
        raise DataError(
            f"{source}: field `completion` is a {type_name(value)}, expected {form}. Fix: store the completion "
            f"text as a string" + (" or use format `auto`." if format != "auto" else ".")
        )
    return UnpairedRecord(prompt=prompt, completion=completion, desirable=desirable, source=source)


# --------------------------------------------------------------------------------------------- tokenizing


def tokenize_unpaired(
    record: UnpairedRecord,
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    chat_template: str = "auto",
) -> Dict[str, Any]:
    """Tokenize one example into ``{"prompt_ids", "completion_ids", "desirable", "max_length"}``.

    Rendering, BOS/EOS handling and truncation are those of
    `hl_core.data.preference.tokenize_preference` with a single completion: ``completion_ids``
    end with EOS and ``len(prompt_ids) + len(completion_ids) <= max_length``. ``max_length`` is stored in
    the feature so that `collate_unpaired` can cap the mismatched (KL) rows the same way.
    """
    prompt_ids, (completion_ids,) = tokenize_prompt_and_completions(
        record.prompt, [record.completion], tokenizer, max_length, max_prompt_length, chat_template
    )
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "desirable": bool(record.desirable),
        "max_length": int(max_length),
    }


# --------------------------------------------------------------------------------------------- collating


def _cap_completion(prompt: List[int], completion: List[int], max_length: Optional[int]) -> List[int]:
    """Cut a completion (whose last token is its EOS) so ``prompt + completion`` fits in ``max_length``;
    the EOS is kept (the rule of the matched rows: cut the text, then append EOS)."""
    if max_length is None or len(prompt) + len(completion) <= max_length:
        return completion
    budget = max(0, max_length - len(prompt) - 1)
    return completion[:-1][:budget] + completion[-1:]


def collate_unpaired(
    features: List[Dict[str, Any]], pad_token_id: int, max_length: Optional[int] = None,
    donors: Optional[List[Dict[str, Any]]] = None, rows: Optional[List[int]] = None,
) -> Dict[str, "torch.Tensor"]:
    """Right-pad B tokenized examples; also build the KTO reference-point (KL) batch.

    Returns long ``[B, T]`` ``input_ids`` / ``attention_mask`` / ``completion_mask`` (row i = prompt_i +
    completion_i), bool ``[B]`` ``desirable``, and long ``[B, T_kl]`` ``kl_input_ids`` /
    ``kl_attention_mask`` / ``kl_completion_mask`` where KL row i = prompt_i + a completion of another
    prompt (`hl_core.objectives.kto.mismatched_pairs`: the micro-batch first, then ``donors``, the
    features of the rest of the rank's / the update's data; zero-``weight`` features lend nothing), and
    bool ``[B]`` ``kl_same_prompt``: True where no other prompt's completion existed. Length cap of the KL
    rows: ``max_length`` when given, else the
    smallest ``"max_length"`` stored in the features by `tokenize_unpaired` (none: no cap); a KL
    completion that does not fit is cut after the prompt, keeping its final EOS.

    ``rows``: the batch holds only ``features[rows]`` while the KL pairing runs over all ``features`` (the
    trainer passes a rank's whole update, so a KL row does not depend on how the update was split into
    micro-batches: ``hl_core.loop.micro_batches``), scanning from ``i + s`` with ``s`` the longest run of one
    prompt in consecutive examples, so a prompt's examples side by side borrow different completions.
    """

    if not features:
        raise ValueError("collate_unpaired needs at least one feature")
    if max_length is None:
        stored = [f["max_length"] for f in features if f.get("max_length") is not None]
        max_length = min(stored) if stored else None
    prompts = [list(f["prompt_ids"]) for f in features]
    completions = [list(f["completion_ids"]) for f in features]
    weights = [f.get("weight", 1.0) for f in features]
    pool = [(f["prompt_ids"], f["completion_ids"]) for f in donors or () if f.get("weight", 1.0) > 0]
    shift = 1
    if rows is not None:  # a whole update: prompts may come in runs (an online pair's two examples side by side)
        runs = [1]
        for previous, prompt in zip(prompts, prompts[1:]):
            runs.append(runs[-1] + 1 if prompt == previous else 1)
        shift = max(runs)
    kl_prompts, kl_completions, same_prompt = mismatched_pairs(prompts, completions, weights, pool, shift=shift)
    if rows is not None:
        pick = lambda values: [values[i] for i in rows]  # noqa: E731
        features, prompts, completions = pick(features), pick(prompts), pick(completions)
        kl_prompts, kl_completions, same_prompt = pick(kl_prompts), pick(kl_completions), pick(same_prompt)
    out = pad_right(
        [p + c for p, c in zip(prompts, completions)],
        [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)],
        pad_token_id,
    )
    out["desirable"] = torch.tensor([bool(f["desirable"]) for f in features], dtype=torch.bool)
    kl_completions = [_cap_completion(p, c, max_length) for p, c in zip(kl_prompts, kl_completions)]
    kl = pad_right(
        [p + c for p, c in zip(kl_prompts, kl_completions)],
        [[0] * len(p) + [1] * len(c) for p, c in zip(kl_prompts, kl_completions)],
        pad_token_id,
    )
    out.update({f"kl_{k}": v for k, v in kl.items()})
    out["kl_same_prompt"] = torch.tensor(same_prompt, dtype=torch.bool)
    return out


__all__ = [
    "UnpairedRecord",
    "load_unpaired_records",
    "parse_unpaired_row",
    "tokenize_unpaired",
    "collate_unpaired",
]
