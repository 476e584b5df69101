"""Per-token log-probabilities of label tokens without a ``[B, T, V]`` float32 copy.

``token_logps(logits, labels)[b, t] = log_softmax(logits[b, t].float())[labels[b, t]]``, computed
chunk by chunk over the sequence so that at most ``[B, chunk, V]`` is ever up-cast to float32.
With ``temperature`` the logits are divided by it first (GRPO at the sampling temperature).
"""

from __future__ import annotations

from typing import Optional

import torch

DEFAULT_CHUNK = 128


def chunk_positions(rows: int, chunk_tokens: int) -> int:
    """Sequence positions per float32 block so that a block holds about ``chunk_tokens`` tokens over
    ``rows`` sequences (``train.logps_chunk_tokens``): the block's memory does not grow with the rows."""
    return max(1, int(chunk_tokens) // max(1, int(rows)))


def token_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Gathered log-softmax of ``labels`` under ``logits``: ``[B, T, V], [B, T] -> [B, T]`` (float32).

    Equal to ``(logits.float() / temperature).log_softmax(-1).gather(-1, labels[..., None])[..., 0]`` to 1e-5.
    Labels outside ``[0, V)`` (e.g. -100 padding) give 0 and no gradient.

    Memory: besides the logits themselves, autograd keeps one float32 log-sum-exp per token; the backward
    writes the gradient straight into one tensor shaped like the logits, a sequence chunk at a time. At
    most one ``[B, chunk, V]`` float32 block is live in either pass.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)}, "
                         f"{tuple(labels.shape)}")
    vocab = logits.shape[-1]
    valid = (labels >= 0) & (labels < vocab)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    out = _ChunkedTokenLogps.apply(logits, safe_labels, int(chunk_size), float(temperature))
    return out * valid.to(out.dtype)


def _float_chunk(logits: torch.Tensor, start: int, end: int, temperature: float) -> torch.Tensor:
    """A float32 copy of ``logits[:, start:end]`` divided by ``temperature`` (safe to modify in place)."""
    chunk = logits[:, start:end].to(torch.float32, copy=True)
    if temperature != 1.0:
        chunk.div_(temperature)
    return chunk


class _ChunkedTokenLogps(torch.autograd.Function):
    """``logp[b, t] = z[b, t, y] - logsumexp_v z[b, t, v]`` with ``z = logits / temperature``, chunked over T.

    Backward: ``d logp / d logits[b, t, v] = (1[v = y] - softmax(z)[b, t, v]) / temperature``, rebuilt from the
    saved log-sum-exp one chunk at a time (no recomputation graph, no per-chunk full-size gradients).

    Vocab-parallel (``group`` given): each rank holds the vocabulary slice starting at ``vocab_start``; the
    max, the sum of exponentials and the label's logit are all-reduced over ``group`` in the forward, and
    the backward needs no communication (each rank's gradient is its own slice's).
    """

    @staticmethod
    def forward(ctx, logits, labels, chunk_size: int, temperature: float, group=None, vocab_start: int = 0):
        rows, steps = labels.shape
        local_vocab = logits.shape[-1]
        out = torch.empty(rows, steps, dtype=torch.float32, device=logits.device)
        lse = torch.empty(rows, steps, dtype=torch.float32, device=logits.device)
        local_labels = labels - vocab_start
        here = (local_labels >= 0) & (local_labels < local_vocab)  # the label's logit is on this rank
        local_labels = torch.where(here, local_labels, torch.zeros_like(local_labels))
        for start in range(0, steps, chunk_size):
            end = min(start + chunk_size, steps)
            chunk = _float_chunk(logits, start, end, temperature)
            picked = chunk.gather(-1, local_labels[:, start:end, None]).squeeze(-1)
            if group is None:
                lse[:, start:end] = torch.logsumexp(chunk, dim=-1)
            else:
                top = chunk.amax(dim=-1)
                torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
                sums = torch.exp(chunk - top[..., None]).sum(dim=-1)
                picked = picked * here[:, start:end]
                stats = torch.stack([sums, picked])
                torch.distributed.all_reduce(stats, group=group)
                lse[:, start:end] = top + torch.log(stats[0])
                picked = stats[1]
            out[:, start:end] = picked - lse[:, start:end]
        ctx.save_for_backward(logits, local_labels, here, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, local_labels, here, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        grad_out = grad_out.to(torch.float32)
        steps = local_labels.shape[1]
        for start in range(0, steps, ctx.chunk_size):
            end = min(start + ctx.chunk_size, steps)
            g = grad_out[:, start:end, None]
            chunk = _float_chunk(logits, start, end, ctx.temperature)
            chunk.sub_(lse[:, start:end, None]).exp_().mul_(-g)  # -softmax * g
            chunk.scatter_add_(-1, local_labels[:, start:end, None], g * here[:, start:end, None])  # + g at the label
            if ctx.temperature != 1.0:
                chunk.div_(ctx.temperature)
            grad[:, start:end] = chunk
        return grad, None, None, None, None, None


def vocab_parallel_logps(logits, labels, chunk_size: int, temperature: float, group, vocab_start: int,
                         vocab_size: int) -> torch.Tensor:
    """``token_logps`` over vocab-parallel logits ``[B, T, V/tp]`` (this rank's slice starts at
    ``vocab_start`` of ``vocab_size``); identical on every rank of ``group``."""
    valid = (labels >= 0) & (labels < vocab_size)
    safe_labels = torch.where(valid, labels, torch.full_like(labels, -1))  # -1: on no rank's slice
    out = _ChunkedTokenLogps.apply(logits, safe_labels, int(chunk_size), float(temperature), group, int(vocab_start))
    return out * valid.to(out.dtype)


def sequence_token_logps(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Log-probs of each token given its prefix, aligned with ``input_ids``: ``[B, T]``, 0 at position 0.

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1``. Multiply by the completion
    mask to keep only completion tokens.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return prefix_token_logps(logits, input_ids, chunk_size, temperature)


def prefix_token_logps(logits: torch.Tensor, input_ids: torch.Tensor, chunk_size: int = DEFAULT_CHUNK,
                       temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probs from a causal LM's logits, in the layout the humanline transforms take.

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1`` and ``out[b, 0] = 0`` (the first token
    has no prefix): the shift is done here, so ``out`` lines up with ``input_ids`` and with a mask over it
    (``mask_from_labels``). Computed a sequence chunk at a time: no ``[B, T, V]`` float32 copy of the logits exists.
    Padding and prompt positions get numbers too; the mask removes them. Our trainer's DeepSpeed engine calls this on
    the model's logits.

    Args:
        logits: the model's output over ``input_ids`` (any float dtype; unshifted, as ``model(input_ids).logits``).
        input_ids: the token ids the model read.
        chunk_size: sequence positions per float32 block.
        temperature: the logits are divided by it first (1.0: the plain log-probs).

    Returns:
        float32 log-probs, 0 at position 0, differentiable with respect to ``logits``.

    Shape:
        ``logits``: ``[B, T, V]``; ``input_ids`` and the output: ``[B, T]``. For DPO, ``B = 2N``: the ``N`` chosen
        rows first, then the ``N`` rejected rows in the same order.
    """
    # score position t's logits against token t + 1 over the whole (unsliced) logits tensor, the last
    # position against an invalid label: slicing the logits would make autograd allocate a second
    # logits-sized gradient for the slice
    labels = next_token_labels(input_ids, torch.ones_like(input_ids, dtype=torch.bool))
    return to_prefix_layout(token_logps(logits, labels, chunk_size=chunk_size, temperature=temperature))


def next_token_labels(input_ids: torch.Tensor, has_next: torch.Tensor) -> torch.Tensor:
    """``labels[b, t] = input_ids[b, t + 1]`` where ``has_next[b, t]`` (the next position continues the same
    sequence), else -1 (not computed)."""
    following = torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), -1)], dim=1)
    return torch.where(has_next, following, torch.full_like(following, -1))


def to_prefix_layout(next_logps: torch.Tensor) -> torch.Tensor:
    """``next_logps[b, t] = log p(token t + 1 | ...)`` to ``out[b, t] = log p(token t | tokens before t)``, 0 at 0."""
    return torch.cat([next_logps.new_zeros(next_logps.shape[0], 1), next_logps[:, :-1]], dim=1)


def mask_from_labels(labels: torch.Tensor, ignore_index: int = -100,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``hl_core.humanline.mask_from_labels`` without its argument checks (its docstring says what it computes):
    ``1`` where ``labels != ignore_index``, 0 elsewhere and at position 0; ``[B, T] -> [B, T]``."""
    mask = (labels != ignore_index).to(dtype)
    mask[:, 0] = 0
    return mask


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)
