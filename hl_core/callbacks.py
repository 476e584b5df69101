"""The trainer's callback seam: three moments of an update where code that is not the loop's runs.

* ``before_optimizer_step(ctx)``: after the update's last backward, the guard and gradient clipping's inputs, and
  before the optimizer step (humanline's reference sync and the look-ahead reference's store run here; the moment
  of transformers' ``TrainerCallback.on_pre_optimizer_step``); it may return a
  :class:`hl_core.humanline.SyncRecord`, which the update's metrics row reports (``synced``, ``sync_time_s``);
* ``after_update(ctx, row)``: after the optimizer step, with the update's metrics row (``ctx.updates_done`` already
  counts it);
* ``on_save(ctx, directory)``: after every rank has written a checkpoint's files into ``directory`` and before rank
  0 marks it complete (a callback may add files to the checkpoint here).

A recipe adds callbacks with ``train.callbacks`` (``package.module:Name`` and its keyword arguments); a script passes
them to ``hl_core.trainer.run(recipe, callbacks=[...])``. A skipped (non-finite) update runs no
``before_optimizer_step``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

from .errors import RecipeError
from .humanline import SyncRecord


@dataclass
class UpdateContext:
    """Where the run stands: ``updates_done`` optimizer updates so far, the ``engine``, the ``output_dir``."""

    updates_done: int
    engine: Any
    output_dir: Path


class TrainerCallback:
    """Override any of the three moments; each default does nothing."""

    def before_optimizer_step(self, ctx: UpdateContext) -> Optional[SyncRecord]:
        return None

    def after_update(self, ctx: UpdateContext, row: Dict[str, Any]) -> None:
        pass

    def on_save(self, ctx: UpdateContext, directory: Path) -> None:
        pass


class CallbackList:
    """The run's callbacks, called in order; ``before_optimizer_step`` merges their sync records (synced if any
    synced, their seconds added)."""

    def __init__(self, callbacks: Iterable[TrainerCallback] = ()):
        self.callbacks: List[TrainerCallback] = list(callbacks)

    def before_optimizer_step(self, ctx: UpdateContext) -> SyncRecord:
        merged = SyncRecord(False)
        for callback in self.callbacks:
            record = callback.before_optimizer_step(ctx)
            if record is not None:
                merged = SyncRecord(merged.synced or record.synced, merged.seconds + record.seconds,
                                    merged.bytes + record.bytes)
        return merged

    def after_update(self, ctx: UpdateContext, row: Dict[str, Any]) -> None:
        for callback in self.callbacks:
            callback.after_update(ctx, row)

    def on_save(self, ctx: UpdateContext, directory: Path) -> None:
        for callback in self.callbacks:
            callback.on_save(ctx, directory)


class ReferenceSyncCallback(TrainerCallback):
    """Humanline's sync (``hl_core.humanline.ReferenceSync``) at the trainer's ``before_optimizer_step``."""

    def __init__(self, sync):
        self.sync = sync

    def before_optimizer_step(self, ctx: UpdateContext) -> SyncRecord:
        return self.sync.before_optimizer_step(ctx.updates_done)


def build_callbacks(specs) -> List[TrainerCallback]:
    """The recipe's ``train.callbacks``: each ``path`` imported and called with its ``args``; a refusal (exit 2)
    names the entry when it cannot be imported, built, or is no ``TrainerCallback``."""
    built = []
    for i, spec in enumerate(specs):
        key = f"train.callbacks[{i}]"
        factory = load_callable(spec.path, key)
        try:
            callback = factory(**spec.args)
        except TypeError as exc:
            raise RecipeError(f"`{key}: {spec.path}` could not be built with the arguments {spec.args} ({exc}). "
                              "Fix: give `args` the keyword arguments it takes.") from None
        if not isinstance(callback, TrainerCallback):
            raise RecipeError(f"`{key}: {spec.path}` built a {type(callback).__name__}, not a TrainerCallback. Fix: "
                              "subclass hl_core.callbacks.TrainerCallback.")
        built.append(callback)
    return built


def load_callable(spec: Optional[str], key: str) -> Callable:
    """``package.module:name`` imported (from the working directory or ``PYTHONPATH``); a refusal (exit 2) names
    ``key`` when it cannot be imported or is not callable."""
    if not spec or ":" not in spec:
        raise RecipeError(f"`{key}` must look like `package.module:function`, got {spec!r}.")
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise RecipeError(f"`{key}: {spec}` could not be imported ({exc}). Fix: check the module path and name.")
    if not callable(fn):
        raise RecipeError(f"`{key}: {spec}` is not callable.")
    return fn
