"""Objectives: pure functions over per-token log-ratios, each returning ``(loss, metrics)``.

The registry maps an ``objective.name`` to an ``ObjectiveSpec`` (the loss function, the kind of data it consumes,
the metric keys it reports). Each function reads the recipe's ``objective`` section at most; what a run decides from
the objective together with other sections (whether it reads the reference, where the reference's log-probs come
from) is decided in ``hl_core.config.decisions``. Humanline is never re-implemented here: the trainer hands each
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


__all__ = [
    "ObjectiveInputs",
    "ObjectiveSpec",
    "OBJECTIVES",
    "register_objective",
    "dpo_loss",
    "kto_loss",
    "kto_reference_point",
    "mismatched_pairs",
    "grpo_loss",
    "group_advantages",
    "sft_loss",
]
