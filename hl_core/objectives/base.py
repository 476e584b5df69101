"""What the trainer hands an objective for one micro-batch (``ObjectiveInputs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


@dataclass
class ObjectiveInputs:
    """One micro-batch, already through the humanline transform.

    * ``policy_logps`` / ``ref_logps``: per-token log-probs ``[N, T]`` (policy with grad, reference without).
    * ``mask``: completion tokens (float 0/1, ``[N, T]``).
    * ``log_ratios``: ``transform(policy_logps, ref_logps, mask)``: clipped, sampled or plain.
    * ``transform``: the same transform, for extra sequences (e.g. KTO's mismatched pairs).
    * ``token_logps(batch, model)``: an extra forward pass of ``"policy"`` or ``"reference"``.
    * ``humanline_active``: humanline is on (a transform or syncing), so ratios are taken against the
      (synced) reference rather than a behaviour policy.
    * ``has_reference``: False when the trainer skipped the reference forward because nothing reads it
      (``ref_logps`` is then a detached copy of ``policy_logps``).
    * ``update_normalised``: see the field.
    """

    batch: Dict[str, torch.Tensor]
    policy_logps: torch.Tensor
    ref_logps: torch.Tensor
    mask: torch.Tensor
    log_ratios: torch.Tensor
    transform: Callable
    token_logps: Callable[[Dict[str, torch.Tensor], str], torch.Tensor]
    humanline_active: bool
    has_reference: bool = True
    # training: the trainer weights this micro-batch's mean by its share of the update
    # (``hl_core.loop.micro_batches``), so an objective takes plain micro-batch means (GRPO's ``dapo``: no all-reduce)
    update_normalised: bool = False


def weighted_mean(losses: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``mean(losses)``, or ``sum(w * l) / sum(w)`` with per-example ``weights`` (an all-zero weight
    vector gives a zero loss that still carries the graph, so every rank runs the same backward)."""
    if weights is None:
        return losses.mean()
    if float(weights.to(dtype=losses.dtype).sum()) == 0.0:  # the batch's weights: read on the host in training
        return (losses * 0.0).sum()
    weights = weights.to(device=losses.device, dtype=losses.dtype)
    return (losses * weights).sum() / weights.sum()
