"""Shared plumbing of the data loaders (pairs, unpaired KTO examples, GRPO groups).

* reading rows from a local ``.jsonl``/``.json``/``.parquet`` file or a Hugging Face set, each row with its
  place (``file.jsonl:LINE``, 1-based line; ``file:row N``, 0-based, for JSON lists, Parquet and HF sets);
* validating the common row pieces (prompts, message lists, completion texts);
* rendering and tokenizing prompts/completions, the shared truncation rule, right-padding.

Every bad row raises :class:`hl_core.errors.DataError` naming its place and the fix.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from hl_core.errors import DataError, RecipeError, did_you_mean

FORMATS = ("auto", "plain", "messages")
CHAT_TEMPLATE_MODES = ("auto", "none", "raw")
JSONL_EXTENSIONS = (".jsonl",)
JSON_EXTENSIONS = (".json",)
PARQUET_EXTENSIONS = (".parquet", ".pq")
SUPPORTED_EXTENSIONS = JSONL_EXTENSIONS + JSON_EXTENSIONS + PARQUET_EXTENSIONS

PAIR_EXAMPLE = '{"prompt": "...", "chosen": "...", "rejected": "..."}'

Messages = List[Dict[str, str]]


# --------------------------------------------------------------------------------------------- sources


def check_load_args(format: str, limit: Optional[int], path: Any, name: Any, what: str) -> None:
    """Validate the common loader arguments (``what``: e.g. ``"preference data"``)."""
    if format not in FORMATS:
        raise RecipeError(
            f"data format `{format}` is not known; use one of {', '.join(FORMATS)}.{did_you_mean(str(format), FORMATS)}"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RecipeError(f"data limit must be a positive integer or unset, got {limit!r}; fix the `limit` value.")
    if (path is None) == (name is None):
        both = "both" if path is not None else "neither"
        raise DataError(
            f"{what} needs exactly one of `path` (a local .jsonl/.json/.parquet file) or `name` "
            f"(a Hugging Face dataset name), but {both} was given. Fix: set one of them and remove the other."
        )


def iter_source_rows(
    path: Optional[str],
    name: Optional[str],
    split: str,
    config: Optional[str],
    limit: Optional[int],
    data_files: Any,
    what: str = "preference data",
    example: str = PAIR_EXAMPLE,
) -> Tuple[Iterator[Tuple[str, Any]], str]:
    """``(rows, where)``: an iterator of ``(source, row)`` and the label of the whole file/set."""
    if path is not None:
        return iter_file_rows(str(path), limit, what, example), str(path)
    return iter_hf_rows(name, config, split, limit, data_files), hf_label(name, config, split)


def load_rows(
    parse, path, name, split, config, format, limit, data_files, what: str, example: str, fields: str
) -> list:
    """The shared loader: check the arguments, read the rows, ``parse(row, source, format)`` each (a record
    or a list of records), stop after ``limit`` source rows, and refuse an empty source.

    ``what`` names the data in messages (e.g. ``"KTO data"``), ``fields`` the fields a row needs.
    """
    check_load_args(format, limit, path, name, what)
    rows, where = iter_source_rows(path, name, split, config, limit, data_files, what, example)
    records: list = []
    for n_rows, (source, row) in enumerate(rows, start=1):
        parsed = parse(row, source, format)
        records.extend(parsed if isinstance(parsed, list) else [parsed])
        if limit is not None and n_rows >= limit:
            break
    if not records:
        noun = what[: -len(" data")] if what.endswith(" data") else what
        raise DataError(
            f"{where}: contains no {noun} rows. Fix: point the data path/name at a non-empty file or split "
            f"with {fields} fields."
        )
    return records


LOADER_ARGS_DOC = """

    Sources: ``path``, a ``.jsonl`` (one object a line; blank lines are skipped), ``.json`` (a list of objects;
    a ``.json`` file holding JSON lines is read as JSONL) or ``.parquet`` file; or ``name``, loaded with
    ``datasets.load_dataset(name, config, split=split, data_files=data_files)`` (``data_files`` is only passed
    when given, e.g. ``name="json", data_files="x.jsonl"``). Exactly one of ``path``/``name``. ``format``:
    ``"auto"`` (per row), ``"plain"`` or ``"messages"``. ``limit``: keep (and validate) only the first
    ``limit`` source rows. Other keyword arguments go to the row parser.
    """


def row_loader(name: str, parse, what: str, example: str, fields: str, doc: str):
    """A ``load_*_records(path=None, name=None, split="train", config=None, format="auto", limit=None, *,
    data_files=None, **parse_options)`` function: :func:`load_rows` with ``parse`` and its messages bound.
    ``parse(row, source, format, **parse_options)`` turns one row into a record or a list of records."""

    def load(
        path: Optional[str] = None,
        name: Optional[str] = None,
        split: str = "train",
        config: Optional[str] = None,
        format: str = "auto",
        limit: Optional[int] = None,
        *,
        data_files: Any = None,
        **parse_options: Any,
    ) -> list:
        return load_rows(functools.partial(parse, **parse_options), path, name, split, config, format, limit, data_files, what, example, fields)

    load.__name__ = load.__qualname__ = name
    load.__module__ = parse.__module__
    load.__doc__ = doc.rstrip() + LOADER_ARGS_DOC
    return load


def hf_label(name: str, config: Optional[str], split: str) -> str:
    return f"hf:{name}" + (f"/{config}" if config else "") + f"[{split}]"


def iter_file_rows(
    path: str, limit: Optional[int], what: str = "preference data", example: str = PAIR_EXAMPLE
) -> Iterator[Tuple[str, Any]]:
    if os.path.isdir(path) or not os.path.exists(path):
        state = "is a directory" if os.path.isdir(path) else "does not exist"
        raise DataError(
            f"{path}: {what} file {state} (working directory {os.getcwd()}). Fix: give the path of an "
            f"existing {'/'.join(SUPPORTED_EXTENSIONS)} file, or use `name` for a Hugging Face dataset."
        )
    ext = os.path.splitext(path)[1].lower()
    if ext in JSONL_EXTENSIONS:
        yield from iter_jsonl(path, example=example)
    elif ext in JSON_EXTENSIONS:
        yield from iter_json(path, example=example)
    elif ext in PARQUET_EXTENSIONS:
        yield from iter_parquet(path, limit)
    else:
        raise DataError(
            f"{path}: unknown data file extension `{ext or '(none)'}`. Fix: use a .jsonl file (one JSON object a "
            f"line), a .json file (a list of objects) or a .parquet file, or rename the file to its real type."
        )


def read_text(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: is not UTF-8 text ({e}). Fix: re-save the file as UTF-8 JSON.") from None


def iter_jsonl(path: str, text: Optional[str] = None, example: str = PAIR_EXAMPLE) -> Iterator[Tuple[str, Any]]:
    text = read_text(path) if text is None else text
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        source = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{source}: line is not valid JSON ({e.msg} at column {e.colno}). Fix: make every non-blank line "
                f"of the .jsonl file one complete JSON object, e.g. {example}."
            ) from None
        yield source, row


def iter_json(path: str, example: str = PAIR_EXAMPLE) -> Iterator[Tuple[str, Any]]:
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines saved with a .json extension
            yield from iter_jsonl(path, text, example=example)
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
            f"a JSON list [{example}, ...] or as .jsonl."
        )
    for i, row in enumerate(data):
        yield f"{path}:row {i}", row


def iter_parquet(path: str, limit: Optional[int]) -> Iterator[Tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for corrupt/non-parquet files
        raise DataError(f"{path}: could not be read as Parquet ({e}). Fix: re-export the file as Parquet.") from None
    if limit is not None:
        table = table.slice(0, limit)
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}:row {i}", row


def iter_hf_rows(
    name: str, config: Optional[str], split: str, limit: Optional[int], data_files: Any
) -> Iterator[Tuple[str, Any]]:
    import datasets

    label = hf_label(name, config, split)
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


# --------------------------------------------------------------------------------------------- row pieces


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def has(row: Dict[str, Any], field: str) -> bool:
    """Whether ``row`` has ``field`` with a non-null value (Parquet/HF fill absent columns with null)."""
    return row.get(field) is not None


def fields_present(row: Dict[str, Any]) -> str:
    return ", ".join(sorted(str(k) for k, v in row.items() if v is not None)) or "none"


def require_completion(value: Any, field: str, source: str, form: str) -> str:
    """A non-empty completion string (``form``: ``"plain form"``/``"messages form"``, for the message)."""
    if not isinstance(value, str):
        raise DataError(
            f"{source}: field `{field}` is a {type_name(value)}, expected a string ({form}). Fix: store the "
            f"{field} completion as text" + (" or use format `messages`/`auto`." if form == "plain form" else ".")
        )
    if not value.strip():
        raise DataError(
            f"{source}: field `{field}` is an empty completion. Fix: give a non-empty {field} text or remove the "
            f"row from the file (rows are never dropped silently)."
        )
    return value


def check_messages(value: Any, field: str, source: str) -> Messages:
    """A list of ``{role, content}`` string messages (copied, extra keys dropped)."""
    if not isinstance(value, (list, tuple)):
        raise DataError(
            f"{source}: field `{field}` is a {type_name(value)}, expected a list of {{role, content}} messages "
            f"(messages form). Fix: store the conversation as a list, or use plain form with string completions."
        )
    out = []
    for i, msg in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise DataError(
                f"{source}: `{where}` is a {type_name(msg)}, expected a message object "
                f'{{"role": ..., "content": ...}}. Fix: write each message as an object with `role` and `content`.'
            )
        for key in ("role", "content"):
            if not isinstance(msg.get(key), str):
                got = "missing" if msg.get(key) is None else f"a {type_name(msg.get(key))}"
                raise DataError(
                    f"{source}: `{where}.{key}` is {got}, expected a string. Fix: give every message a string "
                    f"`role` (user/assistant/system) and a string `content`."
                )
        out.append({"role": msg["role"], "content": msg["content"]})
    return out


def check_conversation(value: Any, field: str, source: str) -> Messages:
    """A message list whose last message is the assistant completion."""
    conv = check_messages(value, field, source)
    if not conv or conv[-1]["role"] != "assistant":
        last = "is empty" if not conv else f"ends with a `{conv[-1]['role']}` message"
        raise DataError(
            f"{source}: field `{field}` {last}; in messages form its last message must be the assistant "
            f"completion. Fix: end the `{field}` conversation with {{\"role\": \"assistant\", \"content\": ...}}."
        )
    return conv


def missing_prompt_error(source: str, needs: str, field: str = "prompt") -> DataError:
    return DataError(f"{source}: row has no `{field}` field. Fix: add the prompt text as `{field}` ({needs}).")


def parse_prompt(value: Any, source: str, needs: str, field: str = "prompt") -> Messages:
    """A ``prompt`` given as a string (one user message) or a non-empty list of messages.

    ``needs`` completes the missing-field message, e.g. ``"plain form needs `prompt`, `chosen` and ..."``.
    """
    if value is None:
        raise missing_prompt_error(source, needs, field)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)):
        messages = check_messages(value, field, source)
        if not messages:
            raise DataError(f"{source}: field `{field}` is an empty list of messages. Fix: give the prompt text.")
        return messages
    raise DataError(
        f"{source}: field `{field}` is a {type_name(value)}, expected a string or a list of "
        f"{{role, content}} messages. Fix: store the prompt as text."
    )


def check_score(value: Any, field: str, source: str) -> float:
    """A finite real number (bools are rejected: store scores as numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(
            f"{source}: `{field}` is a {type_name(value)} ({value!r}), expected a number. Fix: store every score "
            f"as a finite number (e.g. 1.0 / 0.0 for a correct / wrong answer)."
        )
    score = float(value)
    if not math.isfinite(score):
        raise DataError(
            f"{source}: `{field}` is {value!r}, not a finite number. Fix: replace NaN/inf scores with real reward "
            f"values or remove the row (rows are never dropped silently)."
        )
    return score


# --------------------------------------------------------------------------------------------- tokenizing


def adds_bos(tokenizer) -> bool:
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


def prompt_text(messages: Messages, tokenizer, chat_template: str = "auto") -> str:
    """Render the prompt messages: the chat template with the generation prompt, or plain text.

    ``chat_template``: ``"auto"`` (the tokenizer's template; ``"none"`` when it has none), ``"none"``
    (contents joined by blank lines, then a blank line), ``"raw"`` (contents concatenated as they are,
    e.g. ``123+456=`` for a character-level toy task), or a Jinja template string.
    """
    template = None
    if chat_template == "auto":
        if getattr(tokenizer, "chat_template", None):
            template = "tokenizer"
    elif chat_template == "none":
        pass
    elif chat_template == "raw":
        return "".join(m["content"] for m in messages)
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


def encode_prompt(text: str, tokenizer) -> List[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if adds_bos(tokenizer) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def encode_completion(text: str, tokenizer) -> List[int]:
    """Completion token ids WITHOUT the EOS (appended after truncation)."""
    if tokenizer.eos_token_id is None:
        raise RecipeError("the tokenizer has no eos_token; set one (e.g. tokenizer.eos_token) before training.")
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_lengths(max_length: int, max_prompt_length: int) -> None:
    if max_prompt_length < 1 or max_length <= max_prompt_length:
        raise RecipeError(
            f"need 1 <= max_prompt_length < max_length, got max_prompt_length={max_prompt_length}, "
            f"max_length={max_length}; fix the length settings."
        )


def truncate_completions(
    prompt_ids: List[int],
    completions: Sequence[List[int]],
    max_length: int,
    max_prompt_length: int,
    bos_token_id: Optional[int] = None,
) -> Tuple[List[int], List[List[int]]]:
    """The truncation rule of :func:`hl_core.data.preference.truncate_pair` for any number of completions
    sharing one prompt (completions EXCLUDE the EOS appended afterwards): the longest completion decides
    whether the prompt is cut to its last ``max_prompt_length`` tokens (BOS kept), then every completion is
    cut to ``max_length - len(prompt) - 1`` tokens.
    """
    check_lengths(max_length, max_prompt_length)
    longest = max((len(c) for c in completions), default=0)
    if len(prompt_ids) + longest + 1 > max_length and len(prompt_ids) > max_prompt_length:
        if bos_token_id is not None and prompt_ids and prompt_ids[0] == bos_token_id:
            tail = prompt_ids[len(prompt_ids) - (max_prompt_length - 1):] if max_prompt_length > 1 else []
            prompt_ids = [bos_token_id] + tail
        else:
            prompt_ids = prompt_ids[-max_prompt_length:]
    budget = max_length - len(prompt_ids) - 1
    return prompt_ids, [list(c[:budget]) for c in completions]


def tokenize_prompt_and_completions(
    prompt: Messages,
    completions: Sequence[str],
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    chat_template: str = "auto",
) -> Tuple[List[int], List[List[int]]]:
    """Render + tokenize one prompt and its completions, truncate, append EOS to each completion.

    Returns ``(prompt_ids, completion_ids_with_eos)``.
    """
    text = prompt_text(prompt, tokenizer, chat_template)
    prompt_ids = encode_prompt(text, tokenizer)
    comp_ids = [encode_completion(c, tokenizer) for c in completions]
    prompt_ids, comp_ids = truncate_completions(
        prompt_ids, comp_ids, max_length, max_prompt_length, bos_token_id=tokenizer.bos_token_id
    )
    eos = tokenizer.eos_token_id
    return prompt_ids, [c + [eos] for c in comp_ids]


# --------------------------------------------------------------------------------------------- collating


def pad_right(seqs: Sequence[Sequence[int]], masks: Sequence[Sequence[int]], pad_token_id: int) -> Dict[str, Any]:
    """Right-pad sequences into long ``[N, T]`` ``input_ids``/``attention_mask``/``completion_mask``."""
    import torch

    if pad_token_id is None:
        raise RecipeError("the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the eos token).")
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
