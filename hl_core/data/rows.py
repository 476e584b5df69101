"""Shared plumbing of the data loaders (pairs, unpaired KTO examples, GRPO groups).

* reading rows from a local ``.jsonl``/``.json``/``.parquet`` file or a Hugging Face set, each row with its
  place (``file.jsonl:LINE``, 1-based line; ``file:row N``, 0-based, for JSON lists, Parquet and HF sets);
* validating the common row pieces (prompts, message lists, completion texts);
* (tokenizing, truncation and padding are in `hl_core.data.tokens`).

Every bad row raises `hl_core.errors.DataError` naming its place and the fix.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from typing import Any, Dict, Iterator, List, Optional, Tuple

from hl_core.errors import DataError, RecipeError, did_you_mean
from hl_core.storage.text import decode_utf8, lone_surrogate, non_regular_file, read_regular_bytes

FORMATS = ("auto", "plain", "messages")
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
    data_files=None, **parse_options)`` function: `load_rows` with ``parse`` and its messages bound.
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
        return load_rows(functools.partial(parse, **parse_options), path, name, split, config, format, limit,
                         data_files, what, example, fields)

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
    kind = non_regular_file(path)
    if kind is not None:
        raise not_a_regular_file(path, kind, what)
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


def not_a_regular_file(path: str, kind: str, what: str = "data") -> DataError:
    return DataError(
        f"{path}: {what} file is {kind}, not a regular file; reading it would never end or would block (nothing was "
        f"read). Fix: give the path of a regular {'/'.join(SUPPORTED_EXTENSIONS)} file."
    )


def read_text(path: str) -> str:
    raw = read_regular_bytes(path, lambda kind: not_a_regular_file(path, kind))
    return decode_utf8(raw, path, lambda where, detail: DataError(
        f"{where}: is not UTF-8 text ({detail}). Fix: re-save the file as UTF-8 JSON."))


class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _object_without_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    obj: Dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_object_without_duplicates)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _surrogate_field(value: Any) -> Optional[str]:
    """The path (``chosen[1].content``) of the first string (or key) in ``value`` holding a lone UTF-16 surrogate;
    iterative, so no nesting depth can exhaust the stack."""
    stack: List[Tuple[str, Any]] = [("", value)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, str):
            if lone_surrogate(node) is not None:
                return where or "(the row)"
        elif isinstance(node, dict):
            for key, child in reversed(list(node.items())):
                if lone_surrogate(key) is not None:
                    return f"{where}.{key!a}" if where else f"key {key!a}"
                stack.append((f"{where}.{key}" if where else key, child))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", child) for i, child in reversed(list(enumerate(node))))
    return None


def parse_json(text: str, where: str) -> Any:
    """One JSON value of a user's data file, refusing (``DataError`` naming ``where``, e.g. ``file:line``) what the
    standard parser accepts silently or fails on with a traceback: a key given twice in one object (the parser would
    keep the last), strings with lone UTF-16 surrogates (``"\\ud800"``: no text, the tokenizer fails on them),
    nesting deeper than Python's recursion limit and integers too long to convert. ``json.JSONDecodeError`` (a
    syntax error) is left to the caller, which knows the file's form."""
    try:
        value = _DECODER.decode(text)
    except _DuplicateKey as exc:
        raise DataError(
            f"{where}: key `{exc.key}` appears twice in one JSON object; JSON readers silently keep only one of the "
            "two values. Fix: remove or rename one of them."
        ) from None
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise DataError(
            f"{where}: JSON nested too deeply (more than about {sys.getrecursionlimit()} levels of lists or objects). "
            "Fix: a data row is one flat object of strings, message lists and numbers; repair the file."
        ) from None
    except ValueError as exc:  # e.g. an integer of more digits than int() converts
        raise DataError(f"{where}: JSON value cannot be read ({exc}). Fix: repair the value in the file.") from None
    if _SURROGATE_ESCAPE.search(text):  # only a \\ud800-\\udfff escape can put a surrogate into a decoded string
        field = _surrogate_field(value)
        if field is not None:
            raise DataError(
                f"{where}: `{field}` holds a lone UTF-16 surrogate (a `\\ud800`-`\\udfff` escape without its pair), "
                "which is no character: no UTF-8 text holds it and the tokenizer refuses it. Fix: repair the text "
                "(write the character itself, or its full surrogate pair), or remove the row."
            )
    return value


def iter_jsonl(path: str, text: Optional[str] = None, example: str = PAIR_EXAMPLE) -> Iterator[Tuple[str, Any]]:
    """Rows of a JSON-lines text. Lines end at "\\n" only (a trailing "\\r" is whitespace to JSON): JSON strings
    may hold U+2028, U+2029 or U+0085 raw, which ``str.splitlines`` would take for line ends."""
    text = read_text(path) if text is None else text
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        source = f"{path}:{lineno}"
        try:
            row = parse_json(line, source)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{source}: line is not valid JSON ({e.msg} at column {e.colno}). Fix: make every non-blank line "
                f"of the .jsonl file one complete JSON object, e.g. {example}."
            ) from None
        yield source, row


def _locate_in_list(text: str, path: str) -> Optional[DataError]:
    """For a .json file whose whole text `parse_json` refused: the same refusal for the first item of its
    top-level list that has the problem, naming ``path:line (row i)``; None when that cannot be found."""
    ws = re.compile(r"[ \t\n\r]*")
    try:
        index = ws.match(text).end()
        if text[index] != "[":
            return None
        index, row = ws.match(text, index + 1).end(), 0
        while text[index] != "]":
            _, end = json.JSONDecoder().raw_decode(text, index)
            parse_json(text[index:end], f"{path}:{text.count(chr(10), 0, index) + 1} (row {row})")
            index, row = ws.match(text, end).end(), row + 1
            if text[index] == ",":
                index = ws.match(text, index + 1).end()
    except DataError as located:
        return located
    except (ValueError, IndexError, RecursionError):
        return None
    return None


def iter_json(path: str, example: str = PAIR_EXAMPLE) -> Iterator[Tuple[str, Any]]:
    text = read_text(path)
    try:
        data = parse_json(text, path)
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
    except DataError as problem:
        raise _locate_in_list(text, path) or problem from None
    if not isinstance(data, list):
        raise DataError(
            f"{path}: top-level JSON value is a {type(data).__name__}, not a list of rows. Fix: store the rows as "
            f"a JSON list [{example}, ...] or as .jsonl."
        )
    for i, row in enumerate(data):
        yield f"{path}:row {i}", row


def iter_parquet(path: str, limit: Optional[int]) -> Iterator[Tuple[str, Any]]:
    import pyarrow.parquet as pq  # imported here: only Parquet files need it

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
    import datasets  # imported here: only Hugging Face dataset names need it (seconds to import)

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


def absent(row: Dict[str, Any], field: str) -> str:
    """How ``field`` is absent from ``row``, for messages: "field `x` is null" or "row has no `x` field"."""
    return f"field `{field}` is null" if field in row else f"row has no `{field}` field"


def missing_prompt_error(source: str, needs: str, field: str = "prompt",
                         row: Optional[Dict[str, Any]] = None) -> DataError:
    what = absent(row, field) if row is not None else f"row has no `{field}` field"
    return DataError(f"{source}: {what}. Fix: add the prompt text as `{field}` ({needs}).")


def check_prompt_text(messages: Messages, source: str, field: str = "prompt") -> Messages:
    """Refuse a prompt whose every message is empty or whitespace (as empty completions are refused)."""
    if not any(m["content"].strip() for m in messages):
        raise DataError(
            f"{source}: the prompt (`{field}`) is empty or only whitespace. Fix: give the prompt text, or remove the "
            "row from the file (rows are never dropped silently)."
        )
    return messages


def parse_prompt(value: Any, source: str, needs: str, field: str = "prompt") -> Messages:
    """A ``prompt`` given as a string (one user message) or a non-empty list of messages.

    ``needs`` completes the missing-field message, e.g. ``"plain form needs `prompt`, `chosen` and ..."``.
    """
    if value is None:
        raise missing_prompt_error(source, needs, field)
    if isinstance(value, str):
        return check_prompt_text([{"role": "user", "content": value}], source, field)
    if isinstance(value, (list, tuple)):
        messages = check_messages(value, field, source)
        if not messages:
            raise DataError(f"{source}: field `{field}` is an empty list of messages. Fix: give the prompt text.")
        return check_prompt_text(messages, source, field)
    raise DataError(
        f"{source}: field `{field}` is a {type_name(value)}, expected a string or a list of "
        f"{{role, content}} messages. Fix: store the prompt as text."
    )


FLOAT32_MAX = 3.4028234663852886e38  # scores are batched as float32: a larger one becomes inf there


def check_score(value: Any, field: str, source: str) -> float:
    """A finite real number that float32 holds (bools are rejected: store scores as numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise DataError(
            f"{source}: `{field}` is a {type_name(value)} ({value!r}), expected a number. Fix: store every score "
            f"as a finite number (e.g. 1.0 / 0.0 for a correct / wrong answer)."
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(
            f"{source}: `{field}` is {value!r}, not a finite number. Fix: replace NaN/inf scores with real reward "
            f"values or remove the row (rows are never dropped silently)."
        )
    if abs(value) > FLOAT32_MAX:  # compared exactly, also for integers beyond any float (float() would overflow)
        shown = f"an integer of {len(str(abs(value)))} digits" if isinstance(value, int) else repr(value)
        raise DataError(
            f"{source}: `{field}` is {shown}, beyond float32's range (+-3.4e38), in which scores are batched: it "
            "would become inf and turn the group's advantages into NaN. Fix: rescale the scores (e.g. to [0, 1])."
        )
    return float(value)
