"""The trainer's callback seam: code that is not the loop's runs at three moments of an update.

A callback subclasses ``LoopCallback`` and overrides any of its events; each receives one ``CallbackContext`` (the
state it may read, shaped like Megatron-Bridge's ``CallbackContext``) and returns nothing. The events, in the order
they fire in an update (``docs/concepts/callbacks.md`` has the table):

* ``before_optimizer_step(ctx)``: after the update's last backward and the guard's reduction, after the reference's
  sync (what it did: ``ctx.sync``), before the optimizer step (gradient clipping runs inside the step). A skipped
  (non-finite) update runs none;
* ``after_update(ctx)``: after the optimizer step and the metrics row (``ctx.row``; ``ctx.updates_done`` counts it),
  before any evaluation or checkpoint of that update;
* ``on_save(ctx)``: after every rank has written a checkpoint's files into ``ctx.checkpoint_dir`` and before rank 0
  marks it complete (a callback may add files to the checkpoint here).

A recipe adds callbacks with ``train.callbacks`` (``package.module:Name`` and its keyword arguments); a script passes
them to ``hl_core.trainer.run(recipe, callbacks=[...])``. Humanline's reference sync is not a callback: the trainer's
training step runs it (``reference.before_optimizer_step``), then fans the event out to the callbacks with what the
sync did; ``CallbackList`` only fans events out.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

from .errors import RecipeError
from .humanline import SyncRecord


@dataclass
class CallbackContext:
    """What a callback may read. Modifying the run's objects through it is at the callback's own risk.

    Attributes:
        updates_done: optimizer updates done so far (``after_update``: including this one).
        engine: the run's engine (``hl_core.engines.Engine``: ``rank``, ``world_size``, the models).
        output_dir: the run's output directory.
        user_state: one dict for the whole run, shared by every callback and event (keep your own state here).
        sync: ``before_optimizer_step``: what this update's reference sync did (a ``SyncRecord``); else None.
        row: ``after_update``: the update's metrics row, as ``metrics.jsonl`` gets it; else None.
        checkpoint_dir: ``on_save``: the checkpoint being written; else None.
    """

    updates_done: int
    engine: Any
    output_dir: Path
    user_state: Dict[str, Any] = field(default_factory=dict)
    sync: Optional[SyncRecord] = None
    row: Optional[Dict[str, Any]] = None
    checkpoint_dir: Optional[Path] = None


class LoopCallback:
    """A callback of the trainer's loop: override any event; each default does nothing. Events return nothing."""

    def before_optimizer_step(self, ctx: CallbackContext) -> None:
        """After the update's last backward and the reference's sync, before the optimizer step."""

    def after_update(self, ctx: CallbackContext) -> None:
        """After the optimizer step, with the update's metrics row in ``ctx.row``."""

    def on_save(self, ctx: CallbackContext) -> None:
        """After every rank wrote ``ctx.checkpoint_dir``'s files, before the checkpoint is marked complete."""


class CallbackList:
    """The trainer's side of the seam: each event fanned out to the callbacks in order, its part of the context
    filled in."""

    def __init__(self, callbacks: Iterable[LoopCallback] = ()):
        self.callbacks: List[LoopCallback] = list(callbacks)

    def before_optimizer_step(self, ctx: CallbackContext, sync: SyncRecord) -> None:
        ctx.sync = sync
        self._fire("before_optimizer_step", ctx)

    def after_update(self, ctx: CallbackContext, row: Dict[str, Any]) -> None:
        ctx.row = row
        self._fire("after_update", ctx)

    def on_save(self, ctx: CallbackContext, directory: Path) -> None:
        ctx.checkpoint_dir = Path(directory)
        self._fire("on_save", ctx)

    def _fire(self, event: str, ctx: CallbackContext) -> None:
        for callback in self.callbacks:
            if getattr(callback, event)(ctx) is not None:
                raise TypeError(
                    f"{type(callback).__name__}.{event} returned a value: callback events return nothing, and the "
                    "trainer would drop it. Fix: keep what it computes in ctx.user_state (one dict for the run).")


def build_callbacks(specs) -> List[LoopCallback]:
    """The recipe's ``train.callbacks``: each ``path`` imported and called with its ``args``; a refusal (exit 2)
    names the entry when it cannot be imported, built, or is no ``LoopCallback``."""
    built = []
    for i, spec in enumerate(specs):
        key = f"train.callbacks[{i}]"
        factory = load_callable(spec.path, key)
        try:
            callback = factory(**spec.args)
        except TypeError as exc:
            raise RecipeError(f"`{key}: {spec.path}` could not be built with the arguments {spec.args} ({exc}). "
                              "Fix: give `args` the keyword arguments it takes.") from None
        if not isinstance(callback, LoopCallback):
            raise RecipeError(f"`{key}: {spec.path}` built a {type(callback).__name__}, not a LoopCallback. Fix: "
                              "subclass hl_core.callbacks.LoopCallback.")
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
