"""The DPO family (``objective.loss_type``): per-pair losses as pure functions of the pair's two scores.

A completion's *score* is what the loss compares: for the reference-based losses the (humanline-transformed)
per-token log-ratios summed over its tokens (``sigmoid``, ``hinge``, ``robust``) or averaged over them (``ipo``);
for the reference-free ``simpo`` the policy's own per-token log-probs averaged over its tokens. Each function
takes the chosen and the rejected scores (``[B]`` each) and returns the pairs' losses; ``d`` is their difference:

* ``sigmoid`` (DPO, Rafailov et al. 2023): ``-logsigmoid(beta d)``;
* ``hinge`` (SLiC, Zhao et al. 2023): ``relu(1 - beta d)``;
* ``ipo`` (Azar et al. 2023, eq. 17; ``beta`` is their tau): ``(d - 1 / (2 beta))^2``, ``d`` over per-token means;
* ``robust`` (rDPO, Chowdhury et al. 2024; ``eps`` the assumed rate of flipped labels, ``0 <= eps < 1/2``):
  ``(-(1 - eps) logsigmoid(beta d) + eps logsigmoid(-beta d)) / (1 - 2 eps)``;
* ``simpo`` (Meng et al. 2024): ``-logsigmoid(beta d - gamma)``, ``d`` over the policy's per-token mean log-probs.

These are TRL's formulas (``DPOTrainer`` 1.16 for the first four, ``CPOTrainer(loss_type="simpo")`` for SimPO,
``tests/test_dpo_losses.py`` compares them on identical inputs), including TRL's length normalisation of IPO (per
token, as the IPO authors confirmed to TRL). Deliberate differences: humanline clipping or sampling acts on the
per-token log-ratios before any of these see them; ``label_smoothing`` is ``robust``'s ``eps`` only (TRL's
SimPO also accepts a conservative smoothing; here SimPO has none); SimPO has no NLL term (TRL's ``cpo_alpha``: pure
SimPO sets it to 0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch
import torch.nn.functional as F


def sigmoid_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    # the rewards' difference beta c - beta r (rounded as this pack's DPO always computed it)
    return -F.logsigmoid(beta * chosen - beta * rejected)


def hinge_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.relu(1.0 - beta * (chosen - rejected))


def ipo_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float) -> torch.Tensor:
    return (chosen - rejected - 1.0 / (2.0 * beta)) ** 2


def robust_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, eps: float) -> torch.Tensor:
    if not 0.0 <= eps < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {eps}")
    logits = beta * (chosen - rejected)
    return (-(1.0 - eps) * F.logsigmoid(logits) + eps * F.logsigmoid(-logits)) / (1.0 - 2.0 * eps)


def simpo_loss(chosen: torch.Tensor, rejected: torch.Tensor, beta: float, gamma: float) -> torch.Tensor:
    return -F.logsigmoid(beta * (chosen - rejected) - gamma)


@dataclass(frozen=True)
class PairLoss:
    """One ``loss_type``: ``losses(chosen scores, rejected scores, settings)``, ``settings`` holding ``beta``,
    ``label_smoothing`` and ``simpo_gamma`` (``LossSettings``)."""

    losses: Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]
    length_normalised: bool = False  # scores are per-token means, not sums
    reference_free: bool = False  # scores are the policy's own log-probs: no reference, so no humanline


@dataclass(frozen=True)
class LossSettings:
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5


PAIR_LOSSES: Dict[str, PairLoss] = {
    "sigmoid": PairLoss(lambda c, r, s: sigmoid_loss(c, r, s.beta)),
    "hinge": PairLoss(lambda c, r, s: hinge_loss(c, r, s.beta)),
    "ipo": PairLoss(lambda c, r, s: ipo_loss(c, r, s.beta), length_normalised=True),
    "robust": PairLoss(lambda c, r, s: robust_loss(c, r, s.beta, s.label_smoothing)),
    "simpo": PairLoss(lambda c, r, s: simpo_loss(c, r, s.beta, s.simpo_gamma), length_normalised=True,
                      reference_free=True),
}
LOSS_TYPES = tuple(PAIR_LOSSES)


def sequence_score(values: torch.Tensor, mask: torch.Tensor, per_token_mean: bool) -> torch.Tensor:
    """``[B, T] -> [B]``: the sum of ``values`` over the non-masked tokens, or their mean (an empty row: 0). Masked
    positions are selected out, not multiplied by 0: whatever they hold (a NaN in padding) adds exactly 0."""
    total = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dim=-1)
    return total / mask.to(values.dtype).sum(dim=-1).clamp(min=1.0) if per_token_mean else total
