"""What the trainer hands an objective for one micro-batch (``ObjectiveInputs``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

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
    """

    batch: Dict[str, torch.Tensor]
    policy_logps: torch.Tensor
    ref_logps: torch.Tensor
    mask: torch.Tensor
    log_ratios: torch.Tensor
    transform: Callable
    token_logps: Callable[[Dict[str, torch.Tensor], str], torch.Tensor]
    humanline_active: bool
