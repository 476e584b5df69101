"""KTO over (already humanline-transformed) per-token log-ratios.

``r = sum_t d[t]`` per completion; with the reference point ``z0`` (detached):

* desirable:   ``w_D * (1 - sigmoid(beta * (r - z0)))``
* undesirable: ``w_U * (1 - sigmoid(beta * (z0 - r)))``

and the loss is the mean over the micro-batch. ``z0`` comes from ``kto_reference_point`` over the
mismatched pairs built by ``mismatched_pairs``: each prompt with a completion written for another prompt.
In training, ``z0`` and the KL rows are those of the whole update (``kto_prepare_update``; the pairing runs
over the rank's whole update), and the trainer weights each micro-batch by its share of the update
(``hl_core.loop.micro_batches``), so the update's loss does not depend on its split into micro-batches.
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
    "rewards/undesirable", "policy/margin", "policy/logp_desirable", "policy/logp_undesirable",
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
    shift: int = 1,
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
    says so. ``shift``: the scan starts at ``j = i + shift`` instead (then wraps round to ``i + 1``), e.g.
    2 when each prompt's examples come in pairs side by side, so that the two rows of a prompt borrow
    different completions. Returns ``(prompts, kl_completions, same_prompt)``.
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
        order = [*range(min(shift, n - 1) if n > 1 else 1, n), *range(1, min(shift, n - 1) if n > 1 else 1)]
        in_batch = [(prompt_ids[j], completion_ids[j]) for j in ((i + k) % n for k in order) if weights[j] > 0]
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
        stats = _kl_stats(kl_logratios, kl_mask, weights)
    return _z0(stats, group).to(kl_logratios.dtype).detach()


def _kl_stats(kl_logratios: torch.Tensor, kl_mask: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``[sum of the KL rows' sequence sums, number of non-zero ones]`` (rows of weight-0 examples left out)."""
    seq_sums = sequence_logratio(kl_logratios.detach(), kl_mask).to(torch.float64)
    if weights is not None:
        keep = weights.to(device=seq_sums.device).reshape(-1) > 0
        seq_sums = torch.where(keep, seq_sums, torch.zeros_like(seq_sums))
    return torch.stack([seq_sums.sum(), (seq_sums != 0).to(torch.float64).sum()])


def _z0(stats: torch.Tensor, group: Optional[object] = None) -> torch.Tensor:
    """``max(0, sum / count)`` of ``_kl_stats`` summed over ranks (one all-reduce when distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend(group) == "nccl":
            stats = stats.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.all_reduce(stats, op=torch.distributed.ReduceOp.SUM, group=group)
    total, count = stats[0], stats[1]
    return (total / count.clamp(min=1.0)).clamp(min=0.0).detach()


@torch.no_grad()
def kto_prepare_update(objective_cfg, batches, token_logps, transform) -> Dict[str, float]:
    """Training: one ``z0`` for the whole update, from the KL rows of all its micro-batches on all ranks
    (both models, no grad, the same humanline transform), before the first backward; stored as
    ``batch["kto_z0"]``. So ``z0`` does not depend on how the update was split into micro-batches (with one
    micro-batch per update it is the per-micro-batch ``z0`` of evaluation). Dummy micro-batches run the
    forwards (every rank runs as many) but count in nothing."""
    stats = None  # on the log-probs' device: the update's z0 is summed over ranks there, never read on the host
    for batch in batches:
        kl_batch = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
        kl_policy = token_logps(kl_batch, "policy")
        kl_reference = token_logps(kl_batch, "reference")
        kl_mask = batch["kl_completion_mask"].to(device=kl_policy.device, dtype=kl_policy.dtype)
        kl_logratios, _ = transform(kl_policy, kl_reference, kl_mask)
        if stats is None:
            stats = torch.zeros(2, dtype=torch.float64, device=kl_logratios.device)
        if not batch.get("dummy"):
            stats += _kl_stats(kl_logratios, kl_mask, batch.get("weights"))
    z0 = _z0(stats)
    for batch in batches:
        batch["kto_z0"] = z0
    return {}


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

    Returns ``(loss, metrics)``; metrics (device tensors, but the counts: host numbers from ``desirable``) hold
    ``kto/z0``, the counts ``count/desirable`` and
    ``count/undesirable``, and the mean rewards ``beta * r`` of each kind (``rewards/desirable``,
    ``rewards/undesirable``), a mean being left out when its kind is absent from the batch.
    """
    labels = torch.as_tensor(desirable).to(dtype=torch.bool).reshape(-1)  # where the caller keeps them: the host
    desirable = labels.to(device=logratios.device)
    if desirable.shape[0] != logratios.shape[0]:
        raise ValueError(f"desirable has {desirable.shape[0]} labels for {logratios.shape[0]} sequences")
    z0_t = torch.as_tensor(z0, dtype=logratios.dtype, device=logratios.device).detach()
    rewards = sequence_logratio(logratios, mask)
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (rewards - z0_t)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0_t - rewards)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    loss = weighted_mean(losses, weights)
    with torch.no_grad():
        n_desirable = int(labels.sum())
        n_undesirable = int(labels.numel()) - n_desirable
        metrics = {
            "kto/z0": z0_t,
            "count/desirable": float(n_desirable),
            "count/undesirable": float(n_undesirable),
        }
        if n_desirable:
            metrics["rewards/desirable"] = beta * _rows(rewards, labels).mean()
        if n_undesirable:
            metrics["rewards/undesirable"] = beta * _rows(rewards, ~labels).mean()
    return loss, metrics


def _rows(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``values[keep]`` for a host bool mask: the same elements in the same order, gathered by indices found on
    the host (a boolean mask on the device would read its count back)."""
    return values.index_select(0, keep.nonzero().reshape(-1).to(values.device))


def kto_batch_loss(objective_cfg, inputs) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Trainer entry point: z0 from the batch's mismatched pairs (``kl_*`` keys; both models, no grad,
    the same humanline transform), summed over all ranks; then ``kto_loss``."""
    batch = inputs.batch
    weights = batch.get("weights")
    if "kto_z0" in batch:  # training: the update's z0 (kto_prepare_update)
        z0 = batch["kto_z0"].to(device=inputs.log_ratios.device, dtype=inputs.log_ratios.dtype)
    else:
        kl_batch = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
        with torch.no_grad():
            kl_policy = inputs.token_logps(kl_batch, "policy")
            kl_reference = inputs.token_logps(kl_batch, "reference")
            kl_mask = batch["kl_completion_mask"].to(device=kl_policy.device, dtype=kl_policy.dtype)
            kl_logratios, _ = inputs.transform(kl_policy, kl_reference, kl_mask)
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
        desirable = torch.as_tensor(batch["desirable"]).bool().reshape(-1)  # the collated batch's: on the host
        per_token = sequence_logratio(inputs.policy_logps, inputs.mask) / inputs.mask.sum(-1).clamp(min=1)
        if desirable.any():
            metrics["policy/logp_desirable"] = _rows(per_token, desirable).mean()
        if (~desirable).any():
            metrics["policy/logp_undesirable"] = _rows(per_token, ~desirable).mean()
        if desirable.any() and (~desirable).any():
            # reference-free: mean per-token log-prob of desirable minus undesirable completions (in float64)
            metrics["policy/margin"] = (metrics["policy/logp_desirable"].to(torch.float64)
                                        - metrics["policy/logp_undesirable"].to(torch.float64))
    return loss, metrics


def kto_loss_share(objective_cfg, batch) -> float:
    """What one micro-batch's KTO loss is a mean over: its examples' total weight."""
    weights = batch.get("weights")
    return float(weights.sum()) if weights is not None else float(batch["input_ids"].shape[0])


def kto_metric_weights(objective_cfg, batch) -> Dict[str, Optional[float]]:
    """Each metric's weight in the update's mean (None: a count, summed over the rank's micro-batches)."""
    desirable = batch["desirable"].bool()
    n_desirable, n_undesirable = float(desirable.sum()), float((~desirable).sum())
    weights = batch.get("weights")
    counted = float(desirable.numel()) if weights is None else float((weights > 0).sum())
    return {"kto/z0": 1.0, "kto/kl_same_prompt_frac": counted, "count/desirable": None, "count/undesirable": None,
            "rewards/desirable": n_desirable, "rewards/undesirable": n_undesirable,
            "policy/logp_desirable": n_desirable, "policy/logp_undesirable": n_undesirable, "policy/margin": 1.0}


def kto_finish_metrics(means: Dict[str, float]) -> Dict[str, float]:
    """``policy/margin`` of the update: the difference of its two per-kind means (when both kinds occur)."""
    means = {k: v for k, v in means.items() if k != "policy/margin"}
    if "policy/logp_desirable" in means and "policy/logp_undesirable" in means:
        means["policy/margin"] = means["policy/logp_desirable"] - means["policy/logp_undesirable"]
    return means
