"""GRPO over (already humanline-transformed) per-token log-ratios.

* advantages, per prompt group: ``A = (score - mean(group)) / (std(group) + eps)``, population std (or the
  sample std, ``advantage_std: sample``, as TRL's GRPOTrainer computes it);
* ``rho = exp(d_hl)``; ``per_token = -min(rho * A, clamp(rho, 1 - eps_low, 1 + eps_high) * A) + beta_kl * k3``
  with ``k3 = exp(lp_ref - lp_pol) - (lp_ref - lp_pol) - 1`` on the *unclamped* log-ratio;
* aggregation ``"token"``: sum over all completion tokens / number of completion tokens;
  ``"sequence"``: mean over each sequence's tokens, then mean over sequences; ``"dapo"``: sum over the
  micro-batch's completion tokens / the mean number of completion tokens per rank in this micro-batch over
  all ranks (the open-r1 fork's ``loss_type: dapo``, which the MATH runs used); on one rank it equals
  ``"token"``.

In training these means are over the whole optimizer update, not one micro-batch (``hl_core.loop.micro_batches``:
the trainer weights micro-batch ``m`` by its share): ``"token"`` divides by the completion tokens of the
rank's whole update, ``"dapo"`` by the update's completion tokens over all ranks / the number of ranks,
``"sequence"`` by the update's sequences. This is the token-level aggregation the method describes, and it
makes the loss independent of how the update is split into micro-batches; with more than one micro-batch
per update it differs from the per-micro-batch means this module computed before (one micro-batch per
update: unchanged). Evaluation still takes means per evaluation batch.

In humanline GRPO the ratio is clipped twice: in log space upstream (``hl_core.humanline``), then by
the PPO clip here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, Optional, Tuple

import torch

AGGREGATIONS = ("token", "sequence", "dapo")
ADVANTAGE_STDS = ("population", "sample")

# every metric ``grpo_batch_loss`` reports (``kl/mean`` only when the run has a reference)
METRIC_KEYS = (
    "clip/low_frac", "clip/high_frac", "clip/frac", "ratio/mean", "advantages/mean", "advantages/std",
    "advantages/min", "advantages/max", "kl/mean", "policy/adv_logp",
)


def group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-4, std: str = "population"
) -> torch.Tensor:
    """``(score - mean(group)) / (std(group) + eps)`` per group; ``std``: ``"population"`` (divide the
    squared deviations by n) or ``"sample"`` (by n - 1).

    ``group_ids`` are arbitrary ints (one per score, not necessarily contiguous or sorted); a group
    of one gets advantage 0.
    """
    if std not in ADVANTAGE_STDS:
        raise ValueError(f"std must be one of {ADVANTAGE_STDS}, got {std!r}")
    scores = torch.as_tensor(scores)
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())
    group_ids = torch.as_tensor(group_ids).reshape(-1)
    if group_ids.device != scores.device:  # only where they differ (the collated batch's stay on the host)
        group_ids = group_ids.to(scores.device)
    scores_flat = scores.reshape(-1)
    if group_ids.shape[0] != scores_flat.shape[0]:
        raise ValueError(f"got {group_ids.shape[0]} group ids for {scores_flat.shape[0]} scores")
    _, index = torch.unique(group_ids, return_inverse=True)
    n_groups = int(index.max()) + 1 if index.numel() else 0
    work = scores_flat.to(torch.float64)
    counts = scores_flat.new_zeros(n_groups, dtype=torch.float64).index_add_(
        0, index, torch.ones_like(work)
    )
    means = torch.zeros_like(counts).index_add_(0, index, work) / counts
    centred = work - means[index]
    divisor = counts if std == "population" else (counts - 1.0).clamp(min=1.0)
    variances = torch.zeros_like(counts).index_add_(0, index, centred * centred) / divisor
    advantages = centred / (variances.sqrt()[index] + eps)
    return advantages.to(scores.dtype).reshape(scores.shape)


def k3_divergence(ref_logratios: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``exp(-x) + x - 1`` of KL(pol || ref), ``x = lp_pol - lp_ref`` (unclamped)."""
    return torch.exp(-ref_logratios) + ref_logratios - 1.0


def grpo_loss(
    logratios: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    ref_logratios: Optional[torch.Tensor] = None,
    beta_kl: float = 0.0,
    aggregation: str = "token",
    tokens_per_rank: Optional[float] = None,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped-surrogate GRPO loss (see the module docstring) over ``[B, T]`` log-ratios.

    ``logratios``: the transformed log-ratios ``d_hl`` (against the synced reference in humanline,
    the behaviour policy otherwise); ``advantages``: ``[B]``; ``ref_logratios``: the unclamped
    ``lp_pol - lp_ref`` for the KL penalty, required when ``beta_kl > 0``; ``tokens_per_rank``: the
    ``"dapo"`` normaliser (`mean_tokens_per_rank`; the local token count when None).

    Returns ``(loss, metrics)``; metrics (0-dim tensors on the log-ratios' device) hold the PPO clip fractions
    (``clip/low_frac``: ``rho < 1 - eps_low`` with ``A < 0``; ``clip/high_frac``: ``rho > 1 + eps_high`` with ``A > 0``;
    and their sum ``clip/frac``), ``ratio/mean``, ``kl/mean`` (when ``ref_logratios`` is given) and the
    advantage mean/std/min/max, all over the completion tokens (advantages over sequences).
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if beta_kl > 0 and ref_logratios is None:
        raise ValueError("beta_kl > 0 needs ref_logratios (the unclamped lp_pol - lp_ref)")
    if advantages.shape[0] != logratios.shape[0]:
        raise ValueError(f"got {advantages.shape[0]} advantages for {logratios.shape[0]} sequences")
    mask_b = mask.bool()
    mask_f = mask_b.to(logratios.dtype)
    zeros = torch.zeros_like(logratios)
    adv = advantages.to(logratios.dtype).reshape(-1, 1)

    ratio = torch.exp(torch.where(mask_b, logratios, zeros))
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    k3 = None
    if ref_logratios is not None:
        k3 = k3_divergence(torch.where(mask_b, ref_logratios.to(logratios.dtype), zeros))
        if beta_kl > 0:
            per_token = per_token + beta_kl * k3
    per_token = per_token * mask_f

    tokens_per_seq = mask_f.sum(dim=-1)
    if aggregation == "token" or (aggregation == "dapo" and tokens_per_rank is None):
        loss = per_token.sum() / tokens_per_seq.sum().clamp(min=1.0)
    elif aggregation == "dapo":
        loss = per_token.sum() / max(float(tokens_per_rank), 1.0)
    else:
        loss = (per_token.sum(dim=-1) / tokens_per_seq.clamp(min=1.0)).mean()

    with torch.no_grad():
        n_tokens = mask_f.sum().to(torch.float64).clamp(min=1.0)

        def token_mean(x: torch.Tensor) -> torch.Tensor:  # in float64, as the host's float(sum) / n_tokens
            return (x.to(logratios.dtype) * mask_f).sum().to(torch.float64) / n_tokens

        low = (ratio < 1.0 - eps_low) & (adv < 0)
        high = (ratio > 1.0 + eps_high) & (adv > 0)
        adv_flat = adv.reshape(-1).float()
        metrics = {
            "clip/low_frac": token_mean(low),
            "clip/high_frac": token_mean(high),
            "clip/frac": token_mean(low | high),
            "ratio/mean": token_mean(ratio),
            "advantages/mean": adv_flat.mean(),
            "advantages/std": adv_flat.std(unbiased=False),
            "advantages/min": adv_flat.min(),
            "advantages/max": adv_flat.max(),
        }
        if k3 is not None:
            metrics["kl/mean"] = token_mean(k3)
    return loss, metrics


def mean_tokens_per_rank(local_tokens: float, group: Optional[object] = None) -> float:
    """The ``"dapo"`` normaliser: completion tokens summed over all ranks / the number of ranks (tensor- or
    pipeline-parallel peers hold the same micro-batch, so they leave this mean unchanged). One all-reduce
    when ``torch.distributed`` is initialised; else ``local_tokens``."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return float(local_tokens)
    backend = torch.distributed.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    total = torch.tensor([float(local_tokens)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    return float(total.item()) / torch.distributed.get_world_size(group)


def grpo_batch_loss(objective_cfg, inputs) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trainer entry point for a batch of whole prompt groups (``scores``, ``group_ids``).

    The ratio is built from ``inputs.log_ratios`` (humanline-transformed ``lp_pol - lp_ref``), as the
    authors' offline GRPO does; when the batch carries behaviour-policy log-probs (``old_logps``, from
    rollouts) and humanline is off, standard GRPO's ``lp_pol - lp_old`` is used instead. The k3 KL
    term always uses the unclamped ``lp_pol - lp_ref``.
    """
    batch, mask = inputs.batch, inputs.mask
    keep = _kept_rows(batch)  # per group weight 0: a best/worst pair under the threshold, a dummy eval batch
    if not bool(keep.all()):
        return _kept_rows_loss(objective_cfg, inputs, keep.to(mask.device))
    # from the collated batch's scores and groups, on the host (grouping on the device reads sizes back)
    advantages = group_advantages(
        batch["scores"], batch["group_ids"], eps=objective_cfg.advantage_eps, std=objective_cfg.advantage_std,
    ).to(inputs.policy_logps.device)
    if "old_logps" in batch and not inputs.humanline_active:
        logratios = (inputs.policy_logps - batch["old_logps"].to(inputs.policy_logps.device)) * mask
    else:
        logratios = inputs.log_ratios
    ref_logratios = (inputs.policy_logps - inputs.ref_logps) * mask if inputs.has_reference else None
    tokens_per_rank = None
    if objective_cfg.aggregation == "dapo" and not inputs.update_normalised:
        counted = batch["completion_mask"] if "completion_mask" in batch else mask  # the batch's is host-side
        tokens_per_rank = mean_tokens_per_rank(float(counted.sum()))
    loss, metrics = grpo_loss(
        logratios, mask, advantages, eps_low=objective_cfg.eps_low, eps_high=objective_cfg.eps_high,
        ref_logratios=ref_logratios, beta_kl=objective_cfg.beta_kl, aggregation=objective_cfg.aggregation,
        tokens_per_rank=tokens_per_rank,
    )
    with torch.no_grad():
        # reference-free: advantage-weighted mean per-token log-prob (rises as better completions gain mass)
        counted = torch.where(mask.bool(), inputs.policy_logps, torch.zeros_like(inputs.policy_logps))
        per_token = counted.sum(-1) / mask.sum(-1).clamp(min=1)
        metrics["policy/adv_logp"] = (advantages.to(per_token.dtype) * per_token).mean()
    return loss, metrics


def _kept_rows_loss(objective_cfg, inputs, keep: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, float]]:
    """``grpo_batch_loss`` over the rows of groups with positive weight only (the others are dropped, as the
    authors drop pairs under the score threshold). With none left: a zero loss that keeps the graph (every rank
    runs the same backward), no metrics, and this rank's share of the ``dapo`` all-reduce (0 tokens)."""
    if not bool(keep.any()):
        if objective_cfg.aggregation == "dapo" and not inputs.update_normalised:
            mean_tokens_per_rank(0.0)
        return (inputs.log_ratios * 0.0).sum(), {}
    rows = keep.nonzero().reshape(-1)
    batch = {k: (v[rows.to(v.device)] if k in _ROW_KEYS else v) for k, v in inputs.batch.items() if k != "weights"}
    kept = replace(inputs, batch=batch, policy_logps=inputs.policy_logps[rows], ref_logps=inputs.ref_logps[rows],
                   mask=inputs.mask[rows], log_ratios=inputs.log_ratios[rows])
    return grpo_batch_loss(objective_cfg, kept)


# per-row tensors of a grouped batch (``scores`` and ``group_ids`` included)
_ROW_KEYS = ("input_ids", "attention_mask", "completion_mask", "scores", "group_ids", "old_logps")


_TOKEN_METRICS = ("clip/low_frac", "clip/high_frac", "clip/frac", "ratio/mean", "kl/mean")
_UPDATE_METRICS = ("advantages/mean", "advantages/std", "advantages/min", "advantages/max")


def _kept_rows(batch) -> torch.Tensor:
    """Bool ``[N]``: rows of groups with positive weight (all rows without ``weights``)."""
    weights = batch.get("weights")
    if weights is None:
        return torch.ones(batch["group_ids"].shape[0], dtype=torch.bool)
    return weights.cpu()[batch["group_ids"].cpu()] > 0


def grpo_loss_share(objective_cfg, batch) -> float:
    """What one micro-batch's GRPO loss is a mean over: its kept completion tokens (``token``, ``dapo``) or
    kept sequences (``sequence``)."""
    keep = _kept_rows(batch)
    if objective_cfg.aggregation == "sequence":
        return float(keep.sum())
    return float(batch["completion_mask"].cpu()[keep].sum())


def grpo_share_scope(objective_cfg) -> str:
    """``dapo`` normalises by the update's tokens over all ranks / the number of ranks; the others per rank."""
    return "world" if objective_cfg.aggregation == "dapo" else "rank"


def grpo_metric_weights(objective_cfg, batch) -> Dict[str, float]:
    keep = _kept_rows(batch)
    tokens = float(batch["completion_mask"].cpu()[keep].sum())
    return {**{key: tokens for key in _TOKEN_METRICS}, "policy/adv_logp": float(keep.sum())}


def grpo_prepare_update(objective_cfg, batches, token_logps, transform) -> Dict[str, float]:
    """The advantage statistics of the rank's whole update (its kept rows; groups never straddle
    micro-batches, so every row's advantage is the same however the update is split)."""
    values = []
    for batch in batches:
        if batch.get("dummy"):
            continue
        advantages = group_advantages(batch["scores"], batch["group_ids"], eps=objective_cfg.advantage_eps,
                                      std=objective_cfg.advantage_std)
        values.append(advantages.cpu()[_kept_rows(batch)].float())
    values = torch.cat(values) if values else torch.zeros(0)
    if not values.numel():
        return {}
    return {"advantages/mean": float(values.mean()), "advantages/std": float(values.std(unbiased=False)),
            "advantages/min": float(values.min()), "advantages/max": float(values.max())}
