"""Objectives: pure functions over per-token log-ratios, each returning ``(loss, metrics)``.

The registry maps the recipe's ``objective.name`` to an ``ObjectiveSpec`` (the loss function, the
kind of data it consumes). Humanline is never re-implemented here: the trainer hands each objective
log-ratios already transformed by ``hl_core.humanline``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

from .dpo import dpo_loss


@dataclass(frozen=True)
class ObjectiveSpec:
    name: str
    loss_fn: Callable
    data_kind: str  # "paired" | "unpaired" | "grouped"


OBJECTIVES: Dict[str, ObjectiveSpec] = {}


def register_objective(spec: ObjectiveSpec) -> None:
    OBJECTIVES[spec.name] = spec


register_objective(ObjectiveSpec("dpo", dpo_loss, "paired"))

__all__ = ["ObjectiveSpec", "OBJECTIVES", "register_objective", "dpo_loss"]
