"""Runtime swaps of an attribute, undone in stack order: the one helper for every place that puts a stand-in where
other code will look it up (an object's method, a module's function), for a block or until undone.

* ``swap(target, name, value)``: ``getattr(target, name)`` is ``value`` for every caller until the handle is undone.
  Swaps of one attribute stack: the newest one is seen, and undoing one (in any order: two trainers whose calls
  interleave undo theirs in the order they finish) takes out that one layer only, so the attribute shows the newest
  layer still in place, and the original once all are undone. The original comes back as it was: an attribute the
  target did not hold itself (a method of its class, a module attribute that was absent) is deleted again, not
  copied onto the target.
* ``swap_in_context(target, name, value)``: the same, seen only by the calling thread or asyncio task (a
  ``contextvars`` context): while any such layer is in place, the attribute is a dispatcher that calls the current
  context's newest value, or the original in a context without one. Two trainers in two threads each see their own
  stand-in of a shared module function.

Both return a ``Swap`` handle: a context manager, and ``undo()`` (idempotent). A target/name pair takes swaps of one
kind at a time (``SwapError`` otherwise), and an attribute changed behind the swaps' back is never silently
overwritten (``SwapError`` names it).
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["Swap", "SwapError", "swap", "swap_in_context", "unswapped"]

_MISSING = object()  # the target held no attribute of its own under the name


class SwapError(RuntimeError):
    """A swap the helper cannot keep consistent: mixed kinds on one attribute, or the attribute replaced by someone
    else while swapped (the message names it and the fix)."""


class Swap:
    """The handle of one swap: ``undo()`` takes its layer out (idempotent); ``with`` undoes it on exit.

    Attributes:
        target: the object whose attribute is swapped.
        name: the attribute's name.
        value: the stand-in this layer holds.
    """

    def __init__(self, slot: "_Slot", value: Any):
        self.target, self.name, self.value = slot.target, slot.name, value
        self._slot, self._done = slot, False

    @property
    def active(self) -> bool:
        """Whether this layer is still in place."""
        return not self._done

    def undo(self) -> None:
        if not self._done:
            self._slot.remove(self)
            self._done = True

    def __enter__(self) -> "Swap":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


class _Slot:
    """The layers swapped into one attribute of one target, and what it held before the first of them."""

    def __init__(self, target: Any, name: str, kind: str):
        self.target, self.name, self.kind = target, name, kind
        own = getattr(target, "__dict__", {})
        self.original = own[name] if name in own else _MISSING
        self.fallback = getattr(target, name, None)  # what a context without a layer calls (the class's, if inherited)
        self.layers: List[Swap] = []
        self.shown: Any = None  # what the slot last set, to notice a change made behind its back
        self.context: contextvars.ContextVar = contextvars.ContextVar(f"swap:{name}", default=())

    def show(self, value: Any) -> None:
        setattr(self.target, self.name, value)
        self.shown = value

    def check_untouched(self) -> None:
        current = getattr(self.target, "__dict__", {}).get(self.name, _MISSING)
        if current is not self.shown:
            raise SwapError(
                f"`{_label(self.target)}.{self.name}` was replaced while swapped (it holds {current!r}, not the "
                "stand-in the swap put there), so undoing the swap would overwrite that change or restore a stale "
                "original. Fix: make every change to this attribute through hl_core.swaps.swap, or undo the swaps "
                "before changing it.")

    def remove(self, layer: Swap) -> None:
        with _LOCK:
            self.check_untouched()
            if self.kind == "context":
                stack = tuple(v for v in self.context.get() if v is not layer)
                self.context.set(stack)
            self.layers = [other for other in self.layers if other is not layer]
            if not self.layers:
                self.restore()
            elif self.kind == "global":
                self.show(self.layers[-1].value)

    def restore(self) -> None:
        if self.original is _MISSING:
            delattr(self.target, self.name)
        else:
            setattr(self.target, self.name, self.original)
        del _SLOTS[(id(self.target), self.name)]

    def dispatcher(self) -> Callable[..., Any]:
        """The callable put in place for context swaps: the current context's newest value, else the original."""
        slot = self

        def dispatch(*args, **kwargs):
            stack = slot.context.get()
            return (stack[-1].value if stack else slot.fallback)(*args, **kwargs)

        dispatch.__name__ = getattr(self.fallback, "__name__", self.name)
        dispatch.__doc__ = getattr(self.fallback, "__doc__", None)
        return dispatch


_LOCK = threading.RLock()
_SLOTS: Dict[Tuple[int, str], _Slot] = {}


def _label(target: Any) -> str:
    return getattr(target, "__name__", None) or type(target).__name__


def _slot(target: Any, name: str, kind: str) -> _Slot:
    key = (id(target), name)
    slot = _SLOTS.get(key)
    if slot is None:
        slot = _SLOTS[key] = _Slot(target, name, kind)
    elif slot.kind != kind:
        raise SwapError(
            f"`{_label(target)}.{name}` is already swapped with {slot.kind}-wide stand-ins, and a {kind}-wide one "
            "cannot stack on them (each kind decides differently who sees which value). Fix: swap this attribute "
            f"with one kind only ({'swap_in_context' if slot.kind == 'context' else 'swap'}).")
    else:
        slot.check_untouched()
    return slot


def swap(target: Any, name: str, value: Any) -> Swap:
    """Put ``value`` in ``target.name`` for every caller until the returned handle is undone.

    Args:
        target: any object with settable attributes (an instance, a class, a module).
        name: the attribute (it need not exist: undoing deletes it again).
        value: the stand-in.

    Returns:
        The handle (``undo()``, or use it as a context manager). Undoing it while newer swaps of the same attribute
        are in place takes out this layer only; the newest remaining one stays visible.

    Raises:
        SwapError: the attribute holds context swaps, or was replaced since the last swap.
    """
    with _LOCK:
        slot = _slot(target, name, "global")
        layer = Swap(slot, value)
        slot.layers.append(layer)
        slot.show(value)
        return layer


def swap_in_context(target: Any, name: str, value: Any) -> Swap:
    """Make the callable ``target.name`` call ``value`` in the calling thread or task only, until undone.

    Other threads and tasks keep calling the original (or their own stand-in). Undo the handle in the context
    that made it (a ``with`` block does).

    Args:
        target: the object holding the callable (typically a module another library calls it through).
        name: the callable's attribute name.
        value: the stand-in, called with the original's arguments.

    Returns:
        The handle (``undo()``, or use it as a context manager).

    Raises:
        SwapError: the attribute holds global swaps, or was replaced since the last swap.
        TypeError: ``target.name`` is not callable.
    """
    with _LOCK:
        if not callable(getattr(target, name, None)):
            raise TypeError(f"swap_in_context replaces a callable, and `{_label(target)}.{name}` is "
                            f"{getattr(target, name, None)!r}. Fix: use hl_core.swaps.swap for a plain attribute.")
        slot = _slot(target, name, "context")
        if not slot.layers:
            slot.show(slot.dispatcher())
        layer = Swap(slot, value)
        slot.context.set(slot.context.get() + (layer,))
        slot.layers.append(layer)
        return layer


def unswapped(target: Any, name: str) -> Any:
    """What ``getattr(target, name)`` gives with no swap in place (the original), whatever is swapped now."""
    with _LOCK:
        slot = _SLOTS.get((id(target), name))
        return getattr(target, name) if slot is None else slot.fallback
