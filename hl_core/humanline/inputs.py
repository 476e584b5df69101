"""The transforms' inputs from a model's output, with the public contract checked first: ``prefix_token_logps``,
``fused_sequence_token_logps`` and ``mask_from_labels``. The arithmetic is ``hl_core.logprobs``' (``__wrapped__``
names the unchecked function, which our trainer's engines call on inputs they built themselves).

One host read per call checks the token ids against the vocabulary (and an attention mask's values): an id outside
``[0, V)`` would otherwise get a log-prob of 0 (e.g. the logits of one tensor-parallel vocabulary slice).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import logprobs
from ..logprobs.hidden import causal_lm
from .contract import dtype_arg, instance_of, real_number, refuse, same_shape, tensor_arg, whole_number

_FIX_IDS = ("pass the full vocabulary's logits [B, T, V] (under tensor parallelism, gather them or compute the "
            "log-probs vocab-parallel, as examples/megatron_dpo.py does) and real token ids (pad with the tokenizer's "
            "pad_token_id, not -100: mask_from_labels takes the -100 labels)")


def _wraps(unchecked):
    """``functools.wraps`` that keeps the checked function's own docstring and sets ``__wrapped__``."""
    def decorate(checked):
        doc = checked.__doc__
        checked = functools.wraps(unchecked)(checked)
        checked.__doc__ = doc
        return checked
    return decorate


def _ids_in_vocab(where: str, input_ids: torch.Tensor, vocab: int) -> None:
    """One host read: every id in ``[0, vocab)``."""
    outside = (input_ids < 0) | (input_ids >= vocab)
    if input_ids.numel() and bool(outside.any()):
        position = outside.nonzero()[0].tolist()
        raise refuse(where, "input_ids", f"token ids in [0, {vocab}) (the logits' vocabulary)", input_ids,
                              _FIX_IDS, shown=f"the id {int(input_ids[tuple(position)])} at {position}")


@_wraps(logprobs.prefix_token_logps)
def prefix_token_logps(logits: torch.Tensor, input_ids: torch.Tensor, chunk_size: int = logprobs.DEFAULT_CHUNK,
                       temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs from a causal LM's logits, in the layout the humanline transforms take.

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1`` and ``out[b, 0] = 0`` (the first token
    has no prefix): the shift is done here, so ``out`` lines up with ``input_ids`` and with a mask over it
    (``mask_from_labels``). Computed a sequence chunk at a time: no ``[B, T, V]`` float32 copy of the logits exists.
    Padding and prompt positions get numbers too; the mask removes them.

    Args:
        logits: the model's output over ``input_ids``: a floating-point ``[B, T, V]`` tensor over the whole
            vocabulary (unshifted, as ``model(input_ids).logits``).
        input_ids: the token ids the model read: an integer ``[B, T]`` tensor on the logits' device, every id in
            ``[0, V)`` (checked: one host read).
        chunk_size: sequence positions per float32 block, a whole number ``>= 1``.
        temperature: the logits are divided by it first: finite, ``> 0`` (1.0: the plain log-probs).

    Returns:
        float32 log-probs, 0 at position 0, differentiable with respect to ``logits``.

    Shape:
        ``logits``: ``[B, T, V]``; ``input_ids`` and the output: ``[B, T]``. For DPO, ``B = 2N``: the ``N`` chosen
        rows first, then the ``N`` rejected rows in the same order.
    """
    where = "prefix_token_logps"
    fix = "pass model(input_ids).logits [B, T, V] and the input_ids [B, T] the model read"
    tensor_arg(where, "logits", logits, 3, ("float",), fix)
    tensor_arg(where, "input_ids", input_ids, 2, ("int",), fix)
    if tuple(input_ids.shape) != tuple(logits.shape[:2]) or input_ids.device != logits.device:
        raise refuse(where, "input_ids", f"of the logits' [B, T] = {list(logits.shape[:2])}, on their "
                              f"device ({logits.device})", input_ids, fix)
    if logits.shape[-1] < 1:
        raise refuse(where, "logits", "a tensor with a vocabulary (V >= 1)", logits, fix)
    chunk_size = whole_number(where, "chunk_size", chunk_size, "pass a whole number >= 1 (default 128)", low=1)
    temperature = real_number(where, "temperature", temperature, "pass a finite temperature > 0 (1.0: none)",
                                low=0.0, low_open=True)
    _ids_in_vocab(where, input_ids, logits.shape[-1])
    if input_ids.shape[1] == 0:  # no positions: nothing to shift
        return torch.zeros(tuple(input_ids.shape), dtype=torch.float32, device=logits.device)
    return logprobs.prefix_token_logps(logits, input_ids, chunk_size, temperature)


@_wraps(logprobs.fused_sequence_token_logps)
def fused_sequence_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               block_tokens: int = 256, temperature: float = 1.0,
                               module: Optional[torch.nn.Module] = None,
                               device: Optional[torch.device] = None) -> torch.Tensor:
    """Per-token log-probs from the last hidden states and the output layer, never holding the ``[B, T, V]`` logits
    (our trainer's ``train.fused_logprobs``): ``prefix_token_logps``' values, to float32 rounding.

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1``; 0 at position 0 and wherever
    ``attention_mask`` is 0. The model is called once (through ``model``, so a training engine's hooks run) with its
    causal LM's forward and output layer swapped, for the call only, for a blockwise log-softmax of the labels.

    Args:
        model: what is called: a Hugging Face causal LM, a PEFT wrapper of one, or a training engine holding one.
        input_ids: an integer ``[B, T]`` tensor, every id in ``[0, V)`` of the output layer (checked: one host read).
        attention_mask: ``[B, T]``, 1 on real tokens and 0 on padding (bool, integer or floating point).
        block_tokens: the most tokens per float32 block of logits, a whole number ``>= 1``.
        temperature: the logits are divided by it first: finite, ``> 0``.
        module: the causal LM inside ``model`` (default: ``model``); its output layer must be a plain
            ``nn.Linear`` (no adapter on it).
        device: where the forward runs (default: where ``input_ids`` are).

    Returns:
        float32 log-probs, differentiable with respect to the model's parameters.

    Shape:
        ``input_ids``, ``attention_mask`` and the output: ``[B, T]`` (DPO: chosen rows first, then rejected).
    """
    where = "fused_sequence_token_logps"
    fix = "pass the causal LM, its input_ids [B, T] and their attention_mask [B, T]"
    instance_of(where, "model", model, torch.nn.Module, "an nn.Module (a causal LM, a PEFT wrapper or an "
                      "engine holding one)", fix)
    if module is not None:
        instance_of(where, "module", module, torch.nn.Module, "the causal LM inside `model`, or None", fix)
    tensor_arg(where, "input_ids", input_ids, 2, ("int",), fix)
    tensor_arg(where, "attention_mask", attention_mask, 2, ("bool", "int", "float"), fix)
    same_shape(where, "attention_mask", attention_mask, "input_ids", input_ids, fix)
    block_tokens = whole_number(where, "block_tokens", block_tokens, "pass a whole number >= 1 (default 256)", low=1)
    temperature = real_number(where, "temperature", temperature, "pass a finite temperature > 0 (1.0: none)",
                                low=0.0, low_open=True)
    head = getattr(causal_lm(module if module is not None else model), "get_output_embeddings", lambda: None)()
    if type(head) is not torch.nn.Linear:
        raise refuse(where, "module" if module is not None else "model", "a causal LM whose output layer "
                              "(get_output_embeddings()) is a plain nn.Linear", head,
                              "pass module= the causal LM inside an engine, keep adapters off the output layer, or "
                              "use prefix_token_logps on the logits")
    if attention_mask.dtype != torch.bool and input_ids.numel() and bool(
            ((attention_mask != 0) & (attention_mask != 1)).any()):
        raise refuse(where, "attention_mask", "0 or 1 at every position", attention_mask, fix)
    _ids_in_vocab(where, input_ids, head.out_features)
    return logprobs.fused_sequence_token_logps(model, input_ids, attention_mask, block_tokens, temperature, module,
                                               device)


@_wraps(logprobs.mask_from_labels)
def mask_from_labels(labels: torch.Tensor, ignore_index: int = -100,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The token mask the transforms take, from Hugging Face style labels (``ignore_index`` on the prompt and the
    padding, the token id on every completion token).

    ``mask[b, t] = 1`` where ``labels[b, t] != ignore_index``, else 0; position 0 is always 0 (no log-prob there:
    ``prefix_token_logps``). Equal to our collators' ``completion_mask`` (prompt 0, completion and its EOS 1,
    padding 0) for labels built the same way.

    Args:
        labels: an integer ``[B, T]`` tensor of unshifted labels, aligned with ``input_ids`` (as passed to a Hugging
            Face model's ``labels=``); a 1-D tensor is refused (``labels[None]`` for one sequence).
        ignore_index: the whole number that marks a token that does not count.
        dtype: the mask's dtype (floating point or ``torch.bool``).

    Returns:
        A 0/1 mask.

    Shape:
        ``labels`` and the output: ``[B, T]``.
    """
    where = "mask_from_labels"
    fix = "pass labels [B, T] (labels[None] for a single sequence), -100 where a token does not count"
    tensor_arg(where, "labels", labels, 2, ("int",), fix)
    ignore_index = whole_number(where, "ignore_index", ignore_index, "pass a whole number (default -100)")
    dtype = dtype_arg(where, "dtype", dtype, ("float", "bool"), "pass e.g. torch.float32 or torch.bool")
    if labels.shape[1] == 0:  # no positions
        return torch.zeros(tuple(labels.shape), dtype=dtype, device=labels.device)
    return logprobs.mask_from_labels(labels, ignore_index, dtype)
