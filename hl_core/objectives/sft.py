"""Supervised fine-tuning (the warm-up of the reproduction study): token-level negative log-likelihood.

``loss = -sum_t lp_pol[t] * mask[t] / sum_t mask[t]`` over all completion tokens of the micro-batch; in
training, over those of the whole update (the trainer weights each micro-batch by its tokens:
``hl_core.loop.micro_batches``).
No reference model and no humanline transform are involved.
"""

from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

METRIC_KEYS = ("sft/nll", "sft/ppl")  # every metric ``sft_batch_loss`` reports


def sft_loss(policy_logps: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Mean negative log-likelihood per completion token; metrics ``sft/nll`` and ``sft/ppl``."""
    mask = mask.to(policy_logps.dtype)
    loss = -(policy_logps * mask).sum() / mask.sum().clamp(min=1.0)
    nll = loss.detach().to(torch.float64)  # metrics stay on the device (no host read)
    return loss, {"sft/nll": nll, "sft/ppl": torch.exp(nll.clamp(max=50.0))}


def sft_batch_loss(objective_cfg, inputs) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trainer entry point."""
    return sft_loss(inputs.policy_logps, inputs.mask)


def sft_loss_share(objective_cfg, batch) -> float:
    """What one micro-batch's SFT loss is a mean over: its completion tokens."""
    return float(batch["completion_mask"].sum())


def sft_metric_weights(objective_cfg, batch) -> Dict[str, float]:
    tokens = float(batch["completion_mask"].sum())
    return {key: tokens for key in METRIC_KEYS}


def sft_finish_metrics(means: Dict[str, float]) -> Dict[str, float]:
    """The perplexity of the update is that of its mean NLL per token."""
    if "sft/nll" in means:
        means = {**means, "sft/ppl": math.exp(min(means["sft/nll"], 50.0))}
    return means
