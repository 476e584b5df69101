"""Pairwise preference data: loading, validation, tokenization, truncation and collation.

Rows come in two forms (``format="auto"`` detects the form per row from the type of ``chosen``):

* plain:    ``{"prompt": str, "chosen": str, "rejected": str}``
* messages: ``{"chosen": [{"role", "content"}, ...], "rejected": [...], "prompt": str (optional)}`` as in
  UltraFeedback-style sets (e.g. ``princeton-nlp/llama3-ultrafeedback-armorm``): each list is the whole
  conversation, its final assistant message is the completion and the messages before it are the prompt
  (chosen and rejected must share them). When the lists hold only the assistant message, the ``prompt``
  column is the prompt (a string, or a list of messages as in TRL's conversational format).

Every bad row raises :class:`hl_core.errors.DataError` naming its place -- ``file.jsonl:LINE`` (1-based
line) for JSONL, ``file:row N`` (0-based row index) for JSON lists, Parquet files and Hugging Face sets --
and the fix. Rows are never silently dropped.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from hl_core.errors import DataError, RecipeError, did_you_mean

FORMATS = ("auto", "plain", "messages")
CHAT_TEMPLATE_MODES = ("auto", "none")
JSONL_EXTENSIONS = (".jsonl",)
JSON_EXTENSIONS = (".json",)
PARQUET_EXTENSIONS = (".parquet", ".pq")
SUPPORTED_EXTENSIONS = JSONL_EXTENSIONS + JSON_EXTENSIONS + PARQUET_EXTENSIONS


@dataclass
class PreferenceRecord:
    """One preference pair. ``prompt`` is the conversation before the completion (chat messages)."""

    prompt: List[Dict[str, str]]
    chosen: str
    rejected: str
    source: str  # "file.jsonl:12" / "file.parquet:row 3" / "hf:name[split]:row 3", for error messages


# --------------------------------------------------------------------------------------------- loading


def load_preference_records(
    path: Optional[str] = None,
    name: Optional[str] = None,
    split: str = "train",
    config: Optional[str] = None,
    format: str = "auto",
    limit: Optional[int] = None,
    *,
    data_files: Any = None,
) -> List[PreferenceRecord]:
    """Load and validate preference pairs from a local file (``path``) or a Hugging Face set (``name``).

    ``path``: ``.jsonl`` (one object a line; blank lines are skipped), ``.json`` (a list of objects; a
    ``.json`` file holding JSON lines is read as JSONL) or ``.parquet``. ``name``: loaded with
    ``datasets.load_dataset(name, config, split=split, data_files=data_files)`` (``data_files`` is only
    passed when given, e.g. ``name="json", data_files="x.jsonl"``). Exactly one of ``path``/``name``.
    ``format``: ``"auto"`` (per row), ``"plain"`` or ``"messages"``. ``limit``: keep (and validate) only
    the first ``limit`` rows.
    """
    if format not in FORMATS:
        raise RecipeError(
            f"data format `{format}` is not known; use one of {', '.join(FORMATS)}.{did_you_mean(str(format), FORMATS)}"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RecipeError(f"data limit must be a positive integer or unset, got {limit!r}; fix the `limit` value.")
    if (path is None) == (name is None):
        both = "both" if path is not None else "neither"
        raise DataError(
            f"preference data needs exactly one of `path` (a local .jsonl/.json/.parquet file) or `name` "
            f"(a Hugging Face dataset name), but {both} was given. Fix: set one of them and remove the other."
        )
    rows = _iter_file_rows(str(path), limit) if path is not None else _iter_hf_rows(name, config, split, limit, data_files)
    where = str(path) if path is not None else _hf_label(name, config, split)

    records: List[PreferenceRecord] = []
    for source, row in rows:
        records.append(parse_preference_row(row, source, format))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise DataError(
            f"{where}: contains no preference rows. Fix: point the data path/name at a non-empty file or split "
            f"with `prompt`, `chosen` and `rejected` fields."
        )
    return records


def _hf_label(name: str, config: Optional[str], split: str) -> str:
    return f"hf:{name}" + (f"/{config}" if config else "") + f"[{split}]"


def _iter_file_rows(path: str, limit: Optional[int]) -> Iterator[Tuple[str, Any]]:
    if os.path.isdir(path) or not os.path.exists(path):
        what = "is a directory" if os.path.isdir(path) else "does not exist"
        raise DataError(
            f"{path}: preference data file {what} (working directory {os.getcwd()}). Fix: give the path of an "
            f"existing {'/'.join(SUPPORTED_EXTENSIONS)} file, or use `name` for a Hugging Face dataset."
        )
    ext = os.path.splitext(path)[1].lower()
    if ext in JSONL_EXTENSIONS:
        yield from _iter_jsonl(path)
    elif ext in JSON_EXTENSIONS:
        yield from _iter_json(path)
    elif ext in PARQUET_EXTENSIONS:
        yield from _iter_parquet(path, limit)
    else:
        raise DataError(
            f"{path}: unknown data file extension `{ext or '(none)'}`. Fix: use a .jsonl file (one JSON object a "
            f"line), a .json file (a list of objects) or a .parquet file, or rename the file to its real type."
        )


def _read_text(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: is not UTF-8 text ({e}). Fix: re-save the file as UTF-8 JSON.") from None


def _iter_jsonl(path: str, text: Optional[str] = None) -> Iterator[Tuple[str, Any]]:
    text = _read_text(path) if text is None else text
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{source}: line is not valid JSON ({e.msg} at column {e.colno}). Fix: make every non-blank line "
                f"of the .jsonl file one complete JSON object, e.g. "
                f'{{"prompt": "...", "chosen": "...", "rejected": "..."}}.'
            ) from None
        yield source, row


def _iter_json(path: str) -> Iterator[Tuple[str, Any]]:
    text = _read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines saved with a .json extension
            yield from _iter_jsonl(path, text)
            return
        if not text.strip():
            return  # empty file: reported by the caller as "no rows"
        raise DataError(
            f"{path}:{e.lineno}: file is not valid JSON ({e.msg} at column {e.colno}). Fix: a .json data file must "
            f"hold one JSON list of objects (or use .jsonl with one object a line)."
        ) from None
    if not isinstance(data, list):
        raise DataError(
            f"{path}: top-level JSON value is a {type(data).__name__}, not a list of rows. Fix: store the rows as "
            f'a JSON list [{{"prompt": ..., "chosen": ..., "rejected": ...}}, ...] or as .jsonl.'
        )
    for i, row in enumerate(data):
        yield f"{path}:row {i}", row


def _iter_parquet(path: str, limit: Optional[int]) -> Iterator[Tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt/non-parquet files
        raise DataError(f"{path}: could not be read as Parquet ({e}). Fix: re-export the file as Parquet.") from None
    if limit is not None:
        table = table.slice(0, limit)
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def _iter_hf_rows(
    name: str, config: Optional[str], split: str, limit: Optional[int], data_files: Any
) -> Iterator[Tuple[str, Any]]:
    import datasets

    label = _hf_label(name, config, split)
    kwargs: Dict[str, Any] = {"split": split}
    if data_files is not None:
        kwargs["data_files"] = data_files
    try:
        ds = datasets.load_dataset(name, config, **kwargs)
    except Exception as e:
        raise DataError(
            f"{label}: could not load the Hugging Face dataset ({type(e).__name__}: {e}). Fix: check the dataset "
            f"name, config and split, and network access (or set HF_HUB_OFFLINE=1 with the set already cached)."
        ) from None
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    for i, row in enumerate(ds):
        yield f"{label}:row {i}", row


# --------------------------------------------------------------------------------------------- rows


def parse_preference_row(row: Any, source: str, format: str = "auto") -> PreferenceRecord:
    """Validate one row (plain or messages form) and turn it into a :class:`PreferenceRecord`."""
    if not isinstance(row, dict):
        raise DataError(
            f"{source}: row is a {type(row).__name__}, not an object. Fix: each row must be an object with "
            f"`prompt`, `chosen` and `rejected` fields."
        )
    for field in ("chosen", "rejected"):
        if field not in row or row[field] is None:
            raise DataError(
                f"{source}: row has no `{field}` field (fields present: {', '.join(sorted(map(str, row))) or 'none'}). "
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


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _require_completion(value: Any, field: str, source: str, form: str) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"{source}: field `{field}` is a {_type_name(value)}, expected a string ({form}). Fix: store the "
            f"{field} completion as text" + (" or use format `messages`/`auto`." if form == "plain form" else ".")
        )
    if not value.strip():
        raise DataError(
            f"{source}: field `{field}` is an empty completion. Fix: give a non-empty {field} text or remove the "
            f"row from the file (rows are never dropped silently)."
        )
    return value


def _parse_plain(row: Dict[str, Any], source: str) -> PreferenceRecord:
    if "prompt" not in row or row["prompt"] is None:
        raise DataError(
            f"{source}: row has no `prompt` field. Fix: add the prompt text as `prompt` (plain form needs "
            f"`prompt`, `chosen` and `rejected` strings)."
        )
    chosen = _require_completion(row["chosen"], "chosen", source, "plain form")
    rejected = _require_completion(row["rejected"], "rejected", source, "plain form")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        messages = _check_messages(prompt, "prompt", source)
        if not messages:
            raise DataError(f"{source}: field `prompt` is an empty list of messages. Fix: give the prompt text.")
    else:
        raise DataError(
            f"{source}: field `prompt` is a {_type_name(prompt)}, expected a string or a list of "
            f"{{role, content}} messages. Fix: store the prompt as text."
        )
    return PreferenceRecord(prompt=messages, chosen=chosen, rejected=rejected, source=source)


def _check_messages(value: Any, field: str, source: str) -> List[Dict[str, str]]:
    if not isinstance(value, (list, tuple)):
        raise DataError(
            f"{source}: field `{field}` is a {_type_name(value)}, expected a list of {{role, content}} messages "
            f"(messages form). Fix: store the conversation as a list, or use plain form with string completions."
        )
    out = []
    for i, msg in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise DataError(
                f"{source}: `{where}` is a {_type_name(msg)}, expected a message object "
                f'{{"role": ..., "content": ...}}. Fix: write each message as an object with `role` and `content`.'
            )
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                got = "missing" if msg.get(key) is None else f"a {_type_name(msg.get(key))}"
                raise DataError(
                    f"{source}: `{where}.{key}` is {got}, expected a string. Fix: give every message a string "
                    f"`role` (user/assistant/system) and a string `content`."
                )
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def _parse_messages(row: Dict[str, Any], source: str) -> PreferenceRecord:
    convs = {}
    for field in ("chosen", "rejected"):
        conv = _check_messages(row[field], field, source)
        if not conv or conv[-1]["role"] != "assistant":
            last = "is empty" if not conv else f"ends with a `{conv[-1]['role']}` message"
            raise DataError(
                f"{source}: field `{field}` {last}; in messages form its last message must be the assistant "
                f"completion. Fix: end the `{field}` conversation with {{\"role\": \"assistant\", \"content\": ...}}."
            )
        convs[field] = conv
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


def _adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` normally starts with BOS (e.g. Llama-style tokenizers)."""
    cached = getattr(tokenizer, "_hl_adds_bos", None)
    if cached is not None:
        return cached
    bos = getattr(tokenizer, "bos_token_id", None)
    result = False
    if bos is not None:
        with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        result = bool(with_special) and with_special[0] == bos and (not plain or plain[0] != bos)
    try:
        tokenizer._hl_adds_bos = result
    except Exception:
        pass
    return result


def prompt_text(messages: List[Dict[str, str]], tokenizer, chat_template: str = "auto") -> str:
    """Render the prompt messages: the chat template with the generation prompt, or plain text.

    ``chat_template``: ``"auto"`` (the tokenizer's template; ``"none"`` when it has none), ``"none"``
    (contents joined by blank lines, then a blank line), or a Jinja template string.
    """
    template = None
    if chat_template == "auto":
        if getattr(tokenizer, "chat_template", None):
            template = "tokenizer"
    elif chat_template == "none":
        pass
    elif isinstance(chat_template, str) and ("{{" in chat_template or "{%" in chat_template):
        template = chat_template
    else:
        raise RecipeError(
            f"chat_template `{chat_template}` is not known; use `auto`, `none` or a Jinja template string."
            f"{did_you_mean(str(chat_template), CHAT_TEMPLATE_MODES)}"
        )
    if template is None:
        return "\n\n".join(m["content"] for m in messages) + "\n\n"
    kwargs = {} if template == "tokenizer" else {"chat_template": template}
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)


def _encode_prompt(text: str, tokenizer) -> List[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if _adds_bos(tokenizer) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def _encode_completion(text: str, tokenizer) -> List[int]:
    if tokenizer.eos_token_id is None:
        raise RecipeError("the tokenizer has no eos_token; set one (e.g. tokenizer.eos_token) before training.")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
    if max_prompt_length < 1 or max_length <= max_prompt_length:
        raise RecipeError(
            f"need 1 <= max_prompt_length < max_length, got max_prompt_length={max_prompt_length}, "
            f"max_length={max_length}; fix the length settings."
        )
    longest = max(len(chosen_ids), len(rejected_ids))
    if len(prompt_ids) + longest + 1 > max_length and len(prompt_ids) > max_prompt_length:
        if bos_token_id is not None and prompt_ids and prompt_ids[0] == bos_token_id:
            tail = prompt_ids[len(prompt_ids) - (max_prompt_length - 1):] if max_prompt_length > 1 else []
            prompt_ids = [bos_token_id] + tail
        else:
            prompt_ids = prompt_ids[-max_prompt_length:]
    budget = max_length - len(prompt_ids) - 1
    return prompt_ids, chosen_ids[:budget], rejected_ids[:budget]


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

    Truncation (see :func:`truncate_pair`): if prompt + longer completion + EOS exceeds ``max_length`` and
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
    text = prompt_text(record.prompt, tokenizer, chat_template)
    prompt_ids = _encode_prompt(text, tokenizer)
    chosen_ids = _encode_completion(record.chosen, tokenizer)
    rejected_ids = _encode_completion(record.rejected, tokenizer)
    prompt_ids, chosen_ids, rejected_ids = truncate_pair(
        prompt_ids, chosen_ids, rejected_ids, max_length, max_prompt_length, bos_token_id=tokenizer.bos_token_id
    )
    eos = tokenizer.eos_token_id
    out: Dict[str, List[int]] = {}
    for key, comp in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        comp = comp + [eos]
        out[f"{key}_input_ids"] = prompt_ids + comp
        out[f"{key}_completion_mask"] = [0] * len(prompt_ids) + [1] * len(comp)
    return out


# --------------------------------------------------------------------------------------------- collating


def collate_preference(features: List[Dict[str, List[int]]], pad_token_id: int) -> Dict[str, "torch.Tensor"]:
    """Right-pad a batch of B tokenized pairs into ``[2B, T]`` tensors (rows 0..B-1 chosen, B..2B-1 rejected).

    Returns ``input_ids`` (long, padded with ``pad_token_id``), ``attention_mask`` (long, 1 on real tokens)
    and ``completion_mask`` (long 0/1); T is the longest sequence in the batch.
    """
    import torch

    if not features:
        raise ValueError("collate_preference needs at least one feature")
    if pad_token_id is None:
        raise RecipeError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the eos token).")
    seqs = [f["chosen_input_ids"] for f in features] + [f["rejected_input_ids"] for f in features]
    masks = [f["chosen_completion_mask"] for f in features] + [f["rejected_completion_mask"] for f in features]
    T = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), T), int(pad_token_id), dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    completion_mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        if len(s) != len(m):
            raise ValueError(f"feature row {i}: input_ids and completion_mask lengths differ ({len(s)} vs {len(m)})")
        n = len(s)
        input_ids[i, :n] = torch.as_tensor(s, dtype=torch.long)
        attention_mask[i, :n] = 1
        completion_mask[i, :n] = torch.as_tensor(m, dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "completion_mask": completion_mask}


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
