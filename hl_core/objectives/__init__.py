"""Objectives: pure functions over per-token log-ratios, each returning ``(loss, metrics)``.

The registry maps the recipe's ``objective.name`` to an ``ObjectiveSpec`` (the loss function, the
kind of data it consumes, the metric keys it reports). Humanline is never re-implemented here: the trainer hands each
objective log-ratios already transformed by ``hl_core.humanline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

from . import dpo, grpo, kto, sft
from .base import ObjectiveInputs
from .dpo import dpo_batch_loss, dpo_loss
from .grpo import group_advantages, grpo_batch_loss, grpo_loss
from .kto import kto_batch_loss, kto_loss, kto_reference_point, mismatched_pairs
from .sft import sft_batch_loss, sft_loss


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    loss_fn: Callable
    data_kind: str  # "paired" | "unpaired" | "grouped"
    # (objective_cfg, ObjectiveInputs) -> (loss, metrics): what the trainer calls.
    batch_loss: Optional[Callable] = None
    # rollouts: standard (non-humanline) variant takes the ratio against the behaviour policy's log-probs
    uses_behaviour_logps: bool = False
    # rollouts: log-probs at the sampling temperature (logits / T, policy and reference alike)
    logps_at_sampling_temperature: bool = False
    # (objective_cfg) -> False when nothing reads the reference (SFT, DPO's reference-free SimPO): no forward, no model
    needs_reference: Callable = lambda cfg: True
    # every metric ``batch_loss`` may report: the trainer reduces this fixed set (reporting another is an error)
    metric_keys: Tuple[str, ...] = ()
    # training micro-batches (hl_core.loop.micro_batches): (cfg, batch) -> what the micro-batch loss is a mean over
    loss_share: Optional[Callable] = None
    # (cfg) -> "rank" (the update's mean per rank) or "world" (normalised by the share over ranks / world size)
    share_scope: Callable = lambda cfg: "rank"
    # (cfg, batch) -> {metric: weight in the update's mean, or None for a count summed per rank}
    metric_weights: Callable = lambda cfg, batch: {}
    # (cfg, batches, token_logps, transform) -> statistics of the whole update; may add keys to the batches
    prepare_update: Optional[Callable] = None
    # reduced means -> means with the derived metrics recomputed
    finish_metrics: Optional[Callable] = None


OBJECTIVES: Dict[str, ObjectiveSpec] = {}


def register_objective(spec: ObjectiveSpec) -> None:
    OBJECTIVES[spec.name] = spec


register_objective(ObjectiveSpec(
    "dpo", dpo_loss, "paired", dpo_batch_loss, needs_reference=dpo.dpo_needs_reference, metric_keys=dpo.METRIC_KEYS,
    loss_share=dpo.dpo_loss_share, metric_weights=dpo.dpo_metric_weights))
register_objective(ObjectiveSpec(
    "kto", kto_loss, "unpaired", kto_batch_loss, metric_keys=kto.METRIC_KEYS, loss_share=kto.kto_loss_share,
    metric_weights=kto.kto_metric_weights, prepare_update=kto.kto_prepare_update,
    finish_metrics=kto.kto_finish_metrics))
register_objective(ObjectiveSpec(
    "grpo", grpo_loss, "grouped", grpo_batch_loss, True, True, metric_keys=grpo.METRIC_KEYS,
    loss_share=grpo.grpo_loss_share, share_scope=grpo.grpo_share_scope, metric_weights=grpo.grpo_metric_weights,
    prepare_update=grpo.grpo_prepare_update))
register_objective(ObjectiveSpec(
    "sft", sft_loss, "sft", sft_batch_loss, needs_reference=lambda cfg: False, metric_keys=sft.METRIC_KEYS,
    loss_share=sft.sft_loss_share, metric_weights=sft.sft_metric_weights, finish_metrics=sft.sft_finish_metrics))

def needs_old_logps(recipe) -> bool:
    """Rollouts: whether the objective's ratio is against the behaviour policy's log-probs, kept at sampling
    time (standard GRPO); humanline GRPO takes the ratio against the synced reference instead."""
    return OBJECTIVES[recipe.objective.name].uses_behaviour_logps and not recipe.humanline.enabled


def reference_needed(recipe) -> bool:
    """Whether anything reads the reference's log-probs, and so whether the engine builds a reference model.

    Not for SFT or a reference-free DPO loss (SimPO), and not for standard rollout GRPO without a KL term: its ratio
    is against the behaviour policy's log-probs kept at sampling time. Syncing implies humanline, which always needs
    the reference (the checks refuse humanline with a reference-free objective).
    """
    if not OBJECTIVES[recipe.objective.name].needs_reference(recipe.objective):
        return False
    behaviour_ratio_only = recipe.rollout.every is not None and needs_old_logps(recipe)
    return not (behaviour_ratio_only and getattr(recipe.objective, "beta_kl", 0.0) == 0)

def lookahead_blocker(recipe) -> Optional[str]:
    """Why look-ahead syncing cannot serve this run's reference log-probs (None when it can)."""
    if recipe.humanline.sync_mix != 1.0:
        return (f"`humanline.sync_mix: {recipe.humanline.sync_mix}` mixes the policy into the reference, and the "
                "policy computing log-probs ahead holds its own weights, not the mixture")
    if recipe.rollout.every is not None:
        return ("its batches are rollouts (`rollout.every`), sampled after the sync from the updated policy, so "
                "they are not known at the sync")
    if recipe.train.on_nonfinite == "skip":
        return ("`train.on_nonfinite: skip`: a skipped update does not sync, and the reference it keeps is one "
                "whose log-probs were not computed ahead")
    return None


def reference_mode(recipe) -> Tuple[str, str]:
    """Where the reference's log-probs come from, and why: ``none`` (nothing reads them), ``cached`` (frozen,
    precomputed once: ``train.cache_reference_logps``), ``lookahead`` (synced, computed by the policy at each
    sync for the batches up to the next: ``humanline.reference``) or ``copy`` (a second model)."""
    if not reference_needed(recipe):
        return "none", "nothing reads the reference's log-probs"
    if recipe.train.cache_reference_logps:
        return "cached", "frozen reference, log-probs precomputed once (`train.cache_reference_logps`)"
    if recipe.humanline.sync_every is None:
        return "copy", "frozen reference kept as a second model (`train.cache_reference_logps: true` drops it)"
    if recipe.humanline.reference == "copy":
        return "copy", "`humanline.reference: copy`"
    blocker = lookahead_blocker(recipe)
    if blocker is not None:
        return "copy", f"look-ahead syncing does not apply: {blocker}"
    return "lookahead", "offline data: each sync computes the log-probs of the batches up to the next sync"


def reference_model_needed(recipe) -> bool:
    """Whether the engine builds a second (reference) model."""
    return reference_mode(recipe)[0] == "copy"


__all__ = [
    "lookahead_blocker",
    "reference_mode",
    "reference_model_needed",
    "ObjectiveInputs",
    "ObjectiveSpec",
    "OBJECTIVES",
    "register_objective",
    "needs_old_logps",
    "reference_needed",
    "dpo_loss",
    "kto_loss",
    "kto_reference_point",
    "mismatched_pairs",
    "grpo_loss",
    "group_advantages",
    "sft_loss",
]
