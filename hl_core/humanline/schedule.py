"""When the reference is synced, and how far: every ``k`` optimizer updates, at an offset, by a mix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .contract import real_number, whole_number


@dataclass(frozen=True)
class SyncSchedule:
    """Humanline's sync schedule.

    Args:
        every: ``k``, a whole number ``>= 1``: sync before every update ``n`` with ``n % k == offset``; ``None``
            never syncs (a frozen reference).
        offset: a whole number in ``[0, k)`` (``>= 0`` when ``every`` is None).
        mix: a finite real in ``(0, 1]``: ``1.0`` copies the policy into the reference; ``alpha < 1`` is a soft
            update, ``ref = alpha * policy + (1 - alpha) * ref``.

    Raises:
        HumanlineUsageError: an argument outside the above (``every=1.5``, ``every="2"``, ``offset=0.5``, ...).
    """

    every: Optional[int] = 1
    offset: int = 0
    mix: float = 1.0

    def __post_init__(self):
        where = "SyncSchedule()"
        fix = "e.g. SyncSchedule(every=4, offset=0, mix=1.0): k a whole number >= 1 (or None), 0 <= offset < k"
        every = None if self.every is None else whole_number(where, "every", self.every, fix, low=1)
        offset = whole_number(where, "offset", self.offset, fix, low=0,
                                high=None if every is None else every - 1)
        mix = real_number(where, "mix", self.mix, fix, low=0.0, high=1.0, low_open=True)
        object.__setattr__(self, "every", every)  # plain Python numbers (a numpy int becomes an int)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "mix", mix)

    def due(self, updates_done: int) -> bool:
        """Whether the reference syncs before update ``n = updates_done``: ``n % k == offset`` (``n`` counts optimizer
        updates already done, from 0, so update 0 syncs at offset 0: a no-op when both models start from one
        checkpoint); never when ``every`` is None. ``updates_done``: a whole number ``>= 0``."""
        n = whole_number("SyncSchedule.due", "updates_done", updates_done,
                           "pass the number of optimizer updates already done", low=0)
        return self.every is not None and n % self.every == self.offset
