"""KTO over (already humanline-transformed) per-token log-ratios.

``r = sum_t d[t]`` per completion; with the reference point ``z0`` (detached):

* desirable:   ``w_D * (1 - sigmoid(beta * (r - z0)))``
* undesirable: ``w_U * (1 - sigmoid(beta * (z0 - r)))``

and the loss is the mean over the micro-batch. ``z0`` comes from ``kto_reference_point`` over the
mismatched pairs built by ``mismatched_pairs``: each prompt with a completion written for another prompt.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .base import weighted_mean
from .dpo import sequence_logratio

# every metric ``kto_batch_loss`` reports; the per-kind rewards and ``policy/margin`` only when the batch
# holds that kind (both kinds), so some micro-batches leave them out
METRIC_KEYS = (
    "kto/z0", "kto/kl_same_prompt_frac", "count/desirable", "count/undesirable", "rewards/desirable",
    "rewards/undesirable", "policy/margin",
)


def _pick_mismatched(prompt: Sequence[int], candidates: Sequence[Tuple[Sequence[int], Sequence[int]]],
                     start: int) -> Optional[Sequence[int]]:
    """The first completion of ``candidates`` (scanned circularly from ``start``) whose prompt differs."""
    n = len(candidates)
    for k in range(n):
        other_prompt, completion = candidates[(start + k) % n]
        if list(other_prompt) != list(prompt):
            return completion
    return None


def mismatched_pairs(
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Sequence[Sequence[int]],
    weights: Optional[Sequence[float]] = None,
    donors: Sequence[Tuple[Sequence[int], Sequence[int]]] = (),
) -> Tuple[List[List[int]], List[List[int]], List[bool]]:
    """KL row ``i`` pairs prompt ``x_i`` with a completion written for a *different* prompt.

    ``prompt_ids[i]`` / ``completion_ids[i]`` are the token ids of example ``i`` of the local micro-batch.
    Row ``i`` takes the first ``y_j`` of the micro-batch, scanning ``j = i+1, i+2, ...`` circularly, whose
    prompt differs from ``x_i`` (with distinct prompts this is the circular shift ``y_{(i+1) mod B}``);
    when every other example of the micro-batch shares ``x_i`` (one prompt per micro-batch: an online
    best/worst pair, or a pair's two halves side by side), it scans ``donors``, ``(prompt, completion)``
    pairs from the rest of the rank's / the update's data, from position ``i``. Examples with weight 0
    (``weights``) never lend their completion: the authors drop such pairs. Only when no completion of
    another prompt exists anywhere does row ``i`` fall back to ``y_{(i+1) mod B}``, and ``same_prompt[i]``
    says so. Returns ``(prompts, kl_completions, same_prompt)``.
    """
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(
            f"need one completion per prompt, got {len(prompt_ids)} prompts and {len(completion_ids)} completions"
        )
    n = len(prompt_ids)
    weights = [1.0] * n if weights is None else [float(w) for w in weights]
    prompts = [list(p) for p in prompt_ids]
    kl_completions, same_prompt = [], []
    for i in range(n):
        in_batch = [(prompt_ids[j], completion_ids[j]) for j in ((i + k) % n for k in range(1, n)) if weights[j] > 0]
        pick = _pick_mismatched(prompt_ids[i], in_batch, 0)
        if pick is None and donors:
            pick = _pick_mismatched(prompt_ids[i], donors, i)
        same_prompt.append(pick is None)
        kl_completions.append(list(completion_ids[(i + 1) % n] if pick is None else pick))
    return prompts, kl_completions, same_prompt


def kto_reference_point(
    kl_logratios: torch.Tensor, kl_mask: torch.Tensor, group: Optional[object] = None,
    weights: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``z0 = max(0, sum_ranks sum_b s_b / #{b over ranks: s_b != 0})`` with ``s_b = sum_t d_KL[b, t]``.

    ``kl_logratios`` are the (already transformed) per-token log-ratios ``[B, T]`` of the mismatched
    pairs. Rows whose example has weight 0 (``weights``, ``[B]``: online pairs under the score threshold,
    dummy eval rows) count in neither the sum nor the count. The sum and the count are all-reduced over
    ``group`` when ``torch.distributed`` is initialised. Returns a detached 0-dim tensor (0 when no
    sequence has a non-zero sum).
    """
    with torch.no_grad():
        seq_sums = sequence_logratio(kl_logratios.detach(), kl_mask).to(torch.float64)
        if weights is not None:
            keep = weights.to(device=seq_sums.device).reshape(-1) > 0
            seq_sums = torch.where(keep, seq_sums, torch.zeros_like(seq_sums))
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
    weights = batch.get("weights")
    z0 = kto_reference_point(kl_logratios, kl_mask, weights=weights)
    loss, metrics = kto_loss(
        inputs.log_ratios, inputs.mask, batch["desirable"], z0, beta=objective_cfg.beta,
        desirable_weight=objective_cfg.desirable_weight, undesirable_weight=objective_cfg.undesirable_weight,
        weights=weights,
    )
    with torch.no_grad():
        same = batch.get("kl_same_prompt")
        counted = torch.ones(inputs.mask.shape[0], dtype=torch.bool) if weights is None else weights.cpu() > 0
        if same is not None and counted.any():
            # > 0 when no completion of another prompt existed in the micro-batch, the rank's or the update's
            # data: those KL rows pair a prompt with its own completion (z0 is then no KL estimate)
            metrics["kto/kl_same_prompt_frac"] = float(same.cpu()[counted].float().mean())
        desirable = batch["desirable"].to(inputs.mask.device).bool()
        per_token = sequence_logratio(inputs.policy_logps, inputs.mask) / inputs.mask.sum(-1).clamp(min=1)
        if desirable.any() and (~desirable).any():
            # reference-free: mean per-token log-prob of desirable minus undesirable completions
            metrics["policy/margin"] = float(per_token[desirable].mean() - per_token[~desirable].mean())
    return loss, metrics
