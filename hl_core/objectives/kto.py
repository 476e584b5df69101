"""KTO over (already humanline-transformed) per-token log-ratios.

``r = sum_t d[t]`` per completion; with the reference point ``z0`` (detached):

* desirable:   ``w_D * (1 - sigmoid(beta * (r - z0)))``
* undesirable: ``w_U * (1 - sigmoid(beta * (z0 - r)))``

and the loss is the mean over the micro-batch. ``z0`` comes from ``kto_reference_point`` over the
mismatched pairs ``(x_i, y_{(i+1) mod B})`` built by ``mismatched_pairs``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .base import weighted_mean
from .dpo import sequence_logratio

# every metric ``kto_batch_loss`` reports; the per-kind rewards and ``policy/margin`` only when the batch
# holds that kind (both kinds), so some micro-batches leave them out
METRIC_KEYS = (
    "kto/z0", "count/desirable", "count/undesirable", "rewards/desirable", "rewards/undesirable", "policy/margin",
)


def mismatched_pairs(
    prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
) -> Tuple[List[List[int]], List[List[int]]]:
    """Circular shift of the completions: pair ``i`` is ``(x_i, y_{(i+1) mod B})``.

    ``prompt_ids[i]`` / ``completion_ids[i]`` are the token ids of example ``i`` of the local
    micro-batch. Returns ``(prompts, shifted_completions)`` as new lists of lists, ready to be
    tokenised into the KL batch whose log-ratios feed ``kto_reference_point``. With ``B == 1`` the
    only pair is the matched pair ``(x_0, y_0)``.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"need one completion per prompt, got {len(prompt_ids)} prompts and {len(completion_ids)} completions"
        )
    n = len(prompt_ids)
    prompts = [list(p) for p in prompt_ids]
    shifted = [list(completion_ids[(i + 1) % n]) for i in range(n)]
    return prompts, shifted


def kto_reference_point(
    kl_logratios: torch.Tensor, kl_mask: torch.Tensor, group: Optional[object] = None
) -> torch.Tensor:
    """``z0 = max(0, sum_ranks sum_b s_b / #{b over ranks: s_b != 0})`` with ``s_b = sum_t d_KL[b, t]``.

    ``kl_logratios`` are the (already transformed) per-token log-ratios ``[B, T]`` of the mismatched
    pairs. The sum and the count are all-reduced over ``group`` when ``torch.distributed`` is
    initialised. Returns a detached 0-dim tensor (0 when no sequence has a non-zero sum).
    """
    with torch.no_grad():
        seq_sums = sequence_logratio(kl_logratios.detach(), kl_mask).to(torch.float64)
        stats = torch.stack([seq_sums.sum(), (seq_sums != 0).to(torch.float64).sum()])
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM, group=group)
        total, count = stats[0], stats[1]
        z0 = (total / count.clamp(min=1.0)).clamp(min=0.0)
    return z0.to(kl_logratios.dtype).detach()


def kto_loss(
    logratios: torch.Tensor,
    mask: torch.Tensor,
    desirable: torch.Tensor,
    z0: Union[torch.Tensor, float],
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    weights: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Batch mean of the KTO losses (see the module docstring); ``desirable`` is a bool ``[B]``.

    Returns ``(loss, metrics)``; metrics hold ``kto/z0``, the counts ``count/desirable`` and
    ``count/undesirable``, and the mean rewards ``beta * r`` of each kind (``rewards/desirable``,
    ``rewards/undesirable``), a mean being left out when its kind is absent from the batch.
    """
    desirable = desirable.to(device=logratios.device, dtype=torch.bool).reshape(-1)
    if desirable.shape[0] != logratios.shape[0]:
        raise ValueError(f"desirable has {desirable.shape[0]} labels for {logratios.shape[0]} sequences")
    z0_t = torch.as_tensor(z0, dtype=logratios.dtype, device=logratios.device).detach()
    rewards = sequence_logratio(logratios, mask)
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (rewards - z0_t)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0_t - rewards)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    loss = weighted_mean(losses, weights)
    with torch.no_grad():
        n_desirable = int(desirable.sum())
        n_undesirable = int(desirable.numel()) - n_desirable
        metrics = {
            "kto/z0": float(z0_t),
            "count/desirable": float(n_desirable),
            "count/undesirable": float(n_undesirable),
        }
        if n_desirable:
            metrics["rewards/desirable"] = float(beta * rewards[desirable].mean())
        if n_undesirable:
            metrics["rewards/undesirable"] = float(beta * rewards[~desirable].mean())
    return loss, metrics


def kto_batch_loss(objective_cfg, inputs) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trainer entry point: z0 from the batch's mismatched pairs (``kl_*`` keys; both models, no grad,
    the same humanline transform), summed over all ranks; then ``kto_loss``."""
    batch = inputs.batch
    kl_batch = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
    with torch.no_grad():
        kl_policy = inputs.token_logps(kl_batch, "policy")
        kl_reference = inputs.token_logps(kl_batch, "reference")
        kl_mask = batch["kl_completion_mask"].to(device=kl_policy.device, dtype=kl_policy.dtype)
        kl_logratios, _ = inputs.transform(kl_policy, kl_reference, kl_mask)
    z0 = kto_reference_point(kl_logratios, kl_mask)
    loss, metrics = kto_loss(
        inputs.log_ratios, inputs.mask, batch["desirable"], z0, beta=objective_cfg.beta,
        desirable_weight=objective_cfg.desirable_weight, undesirable_weight=objective_cfg.undesirable_weight,
        weights=batch.get("weights"),
    )
    with torch.no_grad():
        desirable = batch["desirable"].to(inputs.mask.device).bool()
        per_token = sequence_logratio(inputs.policy_logps, inputs.mask) / inputs.mask.sum(-1).clamp(min=1)
        if desirable.any() and (~desirable).any():
            # reference-free: mean per-token log-prob of desirable minus undesirable completions
            metrics["policy/margin"] = float(per_token[desirable].mean() - per_token[~desirable].mean())
    return loss, metrics
