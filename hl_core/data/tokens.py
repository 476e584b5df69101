"""Tokenizing and collating shared by the data kinds: prompt rendering (chat templates), prompt/completion
token ids, the truncation rule (with a count of what it cut), and right-padding."""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from hl_core.errors import DataError, RecipeError, did_you_mean

CHAT_TEMPLATE_MODES = ("auto", "none", "raw")

Messages = List[Dict[str, str]]


@dataclass
class TruncationCount:
    """What `truncate_completions` cut while counting: examples (one prompt with its completions) that
    lost tokens, and the tokens they lost (prompt and completions together)."""

    rows: int = 0
    tokens: int = 0


_COUNTERS: List[TruncationCount] = []


@contextlib.contextmanager
def counting_truncation() -> Iterator[TruncationCount]:
    """Count every truncation inside the ``with`` block (nested blocks each count)."""
    counter = TruncationCount()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def note_truncation(cut_tokens: int) -> None:
    if cut_tokens > 0:
        for counter in _COUNTERS:
            counter.rows += 1
            counter.tokens += cut_tokens


# --------------------------------------------------------------------------------------------- tokenizing


# whether each tokenizer adds BOS, kept beside the tokenizers (keyed by identity, dropped with them), never written
# onto the tokenizer object itself: it belongs to another library
_ADDS_BOS: Dict[int, Tuple[Any, bool]] = {}


def adds_bos(tokenizer) -> bool:
    """Whether ``tokenizer(text)`` normally starts with BOS (e.g. Llama-style tokenizers); asked once per
    tokenizer object."""
    cached = _ADDS_BOS.get(id(tokenizer))
    if cached is not None and cached[0]() is tokenizer:
        return cached[1]
    bos = getattr(tokenizer, "bos_token_id", None)
    result = False
    if bos is not None:
        with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        result = bool(with_special) and with_special[0] == bos and (not plain or plain[0] != bos)
    key = id(tokenizer)
    try:
        _ADDS_BOS[key] = (weakref.ref(tokenizer, lambda _, key=key: _ADDS_BOS.pop(key, None)), result)
    except TypeError:
        pass  # an object without weak references: asked again next time
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
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as exc:
        refusal = chat_template_refusal(exc, "`data.chat_template`" if template != "tokenizer" else
                                        f"the chat template of the tokenizer in `{tokenizer.name_or_path}`")
        if refusal is None:
            raise
        raise refusal from None


class ChatTemplateError(DataError):
    """A chat template raised on one conversation; `at` names the row (the renderer does not know it)."""

    def at(self, source: str) -> DataError:
        return DataError(f"{source}: {self}")


def chat_template_refusal(exc: Exception, which: str) -> Optional[ChatTemplateError]:
    """A `ChatTemplateError` for an exception that the Jinja template ``which`` raised while rendering (its
    ``raise_exception``, a syntax error, or its sandbox stopping an attribute access such as ``__class__``); None
    for any other exception."""
    jinja2 = sys.modules.get("jinja2")  # loaded by whoever rendered: an exception of its type means it is there
    if jinja2 is None or not isinstance(exc, jinja2.TemplateError):
        return None
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return ChatTemplateError(
            f"{which} tried an operation that its sandbox forbids ({exc}); it was stopped and nothing of it ran. "
            "Fix: use a chat template you trust (the model's original one), or `data.chat_template=none`."
        )
    return ChatTemplateError(
        f"{which} failed on this conversation ({type(exc).__name__}: {exc}). Fix: repair the template (or the "
        "conversation, when the template refuses its roles or order), or set `data.chat_template`."
    )


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
    """The truncation rule of `hl_core.data.preference.truncate_pair` for any number of completions
    sharing one prompt (completions EXCLUDE the EOS appended afterwards): the longest completion decides
    whether the prompt is cut to its last ``max_prompt_length`` tokens (BOS kept), then every completion is
    cut to ``max_length - len(prompt) - 1`` tokens. Inside `counting_truncation`, a cut is counted.
    """
    check_lengths(max_length, max_prompt_length)
    before = len(prompt_ids) + sum(len(c) for c in completions)
    longest = max((len(c) for c in completions), default=0)
    if len(prompt_ids) + longest + 1 > max_length and len(prompt_ids) > max_prompt_length:
        if bos_token_id is not None and prompt_ids and prompt_ids[0] == bos_token_id:
            tail = prompt_ids[len(prompt_ids) - (max_prompt_length - 1):] if max_prompt_length > 1 else []
            prompt_ids = [bos_token_id] + tail
        else:
            prompt_ids = prompt_ids[-max_prompt_length:]
    budget = max_length - len(prompt_ids) - 1
    cut = [list(c[:budget]) for c in completions]
    note_truncation(before - len(prompt_ids) - sum(len(c) for c in cut))
    return prompt_ids, cut


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
