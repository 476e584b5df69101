"""Per-token log-probabilities of label tokens without a ``[B, T, V]`` float32 copy.

``token_logps(logits, labels)[b, t] = log_softmax(logits[b, t].float())[labels[b, t]]``, computed
chunk by chunk over the sequence so that at most ``[B, chunk, V]`` is ever up-cast to float32.
With ``temperature`` the logits are divided by it first (GRPO at the sampling temperature).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.utils.checkpoint

DEFAULT_CHUNK = 128


def token_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Gathered log-softmax of ``labels`` under ``logits``: ``[B, T, V], [B, T] -> [B, T]`` (float32).

    Equal to ``logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]`` to 1e-5.
    Labels outside ``[0, V)`` (e.g. -100 padding) give 0.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"expected logits [B, T, V] and labels [B, T], got {tuple(logits.shape)}, {tuple(labels.shape)}")
    vocab = logits.shape[-1]
    valid = (labels >= 0) & (labels < vocab)
    safe_labels = torch.where(valid, labels, torch.zeros_like(labels))
    # With autograd on, each chunk is recomputed in backward (activation checkpointing), so the float32
    # up-cast and its log-sum-exp are never kept for all chunks at once: peak extra memory stays at
    # one [B, chunk, V] float32 block in the forward and in the backward pass.
    checkpointed = torch.is_grad_enabled() and logits.requires_grad
    pieces = []
    for start in range(0, logits.shape[1], chunk_size):
        args = (logits[:, start : start + chunk_size], safe_labels[:, start : start + chunk_size], temperature)
        if checkpointed:
            pieces.append(torch.utils.checkpoint.checkpoint(_chunk_logps, *args, use_reentrant=False))
        else:
            pieces.append(_chunk_logps(*args))
    out = torch.cat(pieces, dim=1) if pieces else logits.new_zeros(labels.shape, dtype=torch.float32)
    return out * valid.to(out.dtype)


def _chunk_logps(logits_chunk: torch.Tensor, labels_chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    chunk = logits_chunk.float()
    if temperature != 1.0:
        chunk = chunk / temperature
    picked = chunk.gather(-1, labels_chunk[..., None]).squeeze(-1)
    return picked - torch.logsumexp(chunk, dim=-1)


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
    shifted = token_logps(logits[:, :-1], input_ids[:, 1:], chunk_size=chunk_size, temperature=temperature)
    return torch.cat([shifted.new_zeros(shifted.shape[0], 1), shifted], dim=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: Optional[int] = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (0 when the mask is empty)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)
