"""DPO and its family over (already humanline-transformed) per-token log-ratios.

``objective.loss_type`` picks the per-pair loss (``dpo_losses.PAIR_LOSSES``); ``sigmoid`` is DPO:
``r_c = beta * sum_t d_c[t]``, ``r_r = beta * sum_t d_r[t]``, ``loss = mean_b -logsigmoid(r_c - r_r)``.
The reference-free ``simpo`` compares the policy's own per-token mean log-probs instead of log-ratios.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .base import weighted_mean
from .dpo_losses import PAIR_LOSSES, LossSettings, sequence_score

# every metric ``dpo_batch_loss`` reports (the trainer reduces exactly these over micro-batches and ranks)
METRIC_KEYS = (
    "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "policy/accuracy", "policy/margin",
)


def sequence_logratio(logratios: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token log-ratios over the non-masked tokens: ``[B, T] -> [B]``."""
    return sequence_score(logratios, mask, per_token_mean=False)


def dpo_loss(
    chosen_logratios: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_logratios: torch.Tensor,
    rejected_mask: torch.Tensor,
    beta: float = 0.1,
    weights: Optional[torch.Tensor] = None,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Batch mean of the ``loss_type`` loss of each pair (weighted by per-pair ``weights`` when given, e.g. online
    pairs whose score gap is under the threshold get 0). For ``simpo`` (reference-free) the first and third
    arguments are the policy's per-token log-probs rather than log-ratios.

    Returns ``(loss, metrics)``; metrics (0-dim tensors on the log-ratios' device: no host read) hold the mean
    chosen/rejected implicit rewards (``beta`` times the summed log-ratio, as TRL logs them for every reference-based
    type; SimPO: ``beta`` times the mean log-prob), the mean margin and the reward accuracy (fraction of pairs with
    chosen reward > rejected, ties counting one half).
    """
    if chosen_logratios.shape[0] != rejected_logratios.shape[0]:
        raise ValueError("chosen and rejected batches must have the same number of pairs")
    kind = PAIR_LOSSES[loss_type]
    losses = kind.losses(sequence_score(chosen_logratios, chosen_mask, kind.length_normalised),
                         sequence_score(rejected_logratios, rejected_mask, kind.length_normalised),
                         LossSettings(beta, label_smoothing, simpo_gamma))
    loss = weighted_mean(losses, weights)
    with torch.no_grad():
        chosen_rewards = beta * sequence_score(chosen_logratios, chosen_mask, kind.reference_free)
        rejected_rewards = beta * sequence_score(rejected_logratios, rejected_mask, kind.reference_free)
        margins = chosen_rewards - rejected_rewards
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margin": margins.mean(),
            # ties (e.g. policy == reference at step 0) count as half right
            "rewards/accuracy": ((margins > 0).float() + 0.5 * (margins == 0).float()).mean(),
        }
    return loss, metrics


def dpo_needs_reference(objective_cfg) -> bool:
    """False for a reference-free ``loss_type`` (SimPO): nothing reads the reference's log-probs."""
    return not PAIR_LOSSES[objective_cfg.loss_type].reference_free


def dpo_batch_loss(objective_cfg, inputs) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trainer entry point: rows ``[:B]`` of a collated pair batch are chosen, rows ``[B:]`` rejected."""
    cfg, mask = objective_cfg, inputs.mask
    # a reference-free loss (SimPO) scores the policy's log-probs; the others the humanline-transformed log-ratios
    values = inputs.log_ratios if dpo_needs_reference(cfg) else inputs.policy_logps
    half = values.shape[0] // 2
    loss, metrics = dpo_loss(values[:half], mask[:half], values[half:], mask[half:], beta=cfg.beta,
                             weights=inputs.batch.get("weights"), loss_type=cfg.loss_type,
                             label_smoothing=cfg.label_smoothing, simpo_gamma=cfg.simpo_gamma)
    metrics.update(policy_preference_metrics(inputs.policy_logps[:half], mask[:half], inputs.policy_logps[half:],
                                             mask[half:]))
    return loss, metrics


@torch.no_grad()
def policy_preference_metrics(chosen_logps, chosen_mask, rejected_logps, rejected_mask) -> Dict[str, torch.Tensor]:
    """Reference-free diagnostics, comparable across plain and humanline runs (whose reference moves):
    ``policy/accuracy`` = fraction of pairs with ``sum log pi(chosen) > sum log pi(rejected)`` (ties: half),
    ``policy/margin`` = mean per-token log-prob of chosen minus rejected."""
    chosen_sum = sequence_logratio(chosen_logps, chosen_mask)
    rejected_sum = sequence_logratio(rejected_logps, rejected_mask)
    chosen_mean = chosen_sum / chosen_mask.sum(-1).clamp(min=1)
    rejected_mean = rejected_sum / rejected_mask.sum(-1).clamp(min=1)
    wins = (chosen_sum > rejected_sum).float() + 0.5 * (chosen_sum == rejected_sum).float()
    return {"policy/accuracy": wins.mean(), "policy/margin": (chosen_mean - rejected_mean).mean()}


def dpo_loss_share(objective_cfg, batch) -> float:
    """What one micro-batch's DPO loss is a mean over: its pairs' total weight (all pairs count 1 without
    ``weights``)."""
    weights = batch.get("weights")
    return float(weights.sum()) if weights is not None else float(batch["input_ids"].shape[0] // 2)


def dpo_metric_weights(objective_cfg, batch) -> Dict[str, float]:
    """Every DPO metric is a mean over the micro-batch's pairs."""
    pairs = float(batch["input_ids"].shape[0] // 2)
    return {key: pairs for key in METRIC_KEYS}
