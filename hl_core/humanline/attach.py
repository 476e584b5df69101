"""What ``ReferenceSync.attach`` hooks into, per kind of optimizer: where the sync must run so that the reference
receives the pre-update weights, once per update.

* a torch optimizer (plain torch, DDP, FSDP2): a step pre-hook, before every ``optimizer.step()``;
* a DeepSpeed engine (ZeRO 0-3): its ``step`` wrapped on the instance; the sync runs first, and only at a gradient
  accumulation boundary (``engine.is_gradient_accumulation_boundary()``), after the boundary's backward and before
  the engine clips gradients and steps. A hook on the optimizer inside the engine would be wrong: ZeRO-3 may step one
  optimizer per parameter sub-group, between sub-group updates;
* a Megatron-core optimizer (``MegatronOptimizer``, ``ChainedOptimizer``): its ``step`` wrapped on the instance
  (gradient clipping and the inner optimizers' steps run inside it; a skipped fp16 step still counts as an update,
  as in Megatron's own loop).

The kinds are declared by class: a DeepSpeed engine is ``deepspeed.DeepSpeedEngine`` and a Megatron optimizer
``megatron.core.optimizer.MegatronOptimizer``; each is looked up only when its package is already imported.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from ..errors import SyncUsageError  # noqa: F401 (its home before 0.1.x; hl_core.humanline exports it)
from ..swaps import swap
from .contract import refuse


def optimizer_kind(target) -> str:
    """``"torch"``, ``"deepspeed"`` or ``"megatron"``; a ``HumanlineUsageError`` for anything else."""
    if isinstance(target, torch.optim.Optimizer):
        return "torch"
    # a DeepSpeed engine or a Megatron optimizer exists only once its package is imported: read the class from
    # sys.modules, so that the humanline API never imports either package itself
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is not None and isinstance(target, deepspeed.DeepSpeedEngine):
        return "deepspeed"
    megatron_optimizer = sys.modules.get("megatron.core.optimizer")
    if megatron_optimizer is not None and isinstance(target, megatron_optimizer.MegatronOptimizer):
        return "megatron"
    raise refuse(
        "ReferenceSync.attach", "target", "a torch optimizer, a DeepSpeed engine or a Megatron-core optimizer", target,
        "pass the object whose step() ends the update, or call sync.before_optimizer_step(updates_done) yourself "
        "between the update's last backward and its step")


class Attachment:
    """The handle ``ReferenceSync.attach`` returns: ``remove()`` detaches the sync (then manual calls are allowed)."""

    def __init__(self, target, kind: str, undo: Callable[[], None], on_remove: Callable[[], None]):
        self.target, self.kind = target, kind
        self._undo, self._on_remove = undo, on_remove

    def remove(self) -> None:
        if self._undo is not None:
            self._undo()
            self._on_remove()
            self._undo = None


def _wrap_step(target, before: Callable[[], None]) -> Callable[[], None]:
    """Swap ``target.step`` on the instance for one that calls ``before()`` first (``hl_core.swaps``); returns the
    undo. Undone, the wrapper passes straight through, so a wrapper stacked on it later keeps working without the
    sync, and undoing takes out this layer only."""
    original = target.step

    def step(*args, **kwargs):
        if layer.active:
            before()
        return original(*args, **kwargs)

    layer = swap(target, "step", step)
    return layer.undo


def hook_into(target, kind: str, sync_next: Callable[[], None]) -> Callable[[], None]:
    """Run ``sync_next()`` once per update of ``target`` (of ``kind``), before its step; returns the undo."""
    if kind == "torch":
        def pre_hook(_optimizer, _args, _kwargs):
            sync_next()  # a step pre-hook returns None: the step's arguments stay as they are

        return target.register_step_pre_hook(pre_hook).remove
    if kind == "deepspeed":
        return _wrap_step(target, lambda: sync_next() if target.is_gradient_accumulation_boundary() else None)
    return _wrap_step(target, sync_next)
