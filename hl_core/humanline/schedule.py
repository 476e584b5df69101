"""When the reference is synced, and how far: every ``k`` optimizer updates, at an offset, by a mix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class SyncSchedule:
    """Humanline's sync schedule.

    Args:
        every: ``k``: sync before every update ``n`` with ``n % k == offset``; ``None`` never syncs (a frozen
            reference).
        offset: in ``[0, k)``.
        mix: ``1.0`` copies the policy into the reference; ``alpha < 1`` is a soft update,
            ``ref = alpha * policy + (1 - alpha) * ref``.
    """

    every: Optional[int] = 1
    offset: int = 0
    mix: float = 1.0

    def __post_init__(self):
        if self.every is not None and self.every < 1:
            raise ValueError(f"the sync period `every` must be >= 1 or None, got {self.every}")
        if self.every is not None and not 0 <= self.offset < self.every:
            raise ValueError(f"the sync offset must be in [0, {self.every}), got {self.offset}")
        if not 0.0 < self.mix <= 1.0:
            raise ValueError(f"the sync's mix must be in (0, 1], got {self.mix}")

    def due(self, updates_done: int) -> bool:
        """Whether the reference syncs before update ``n = updates_done``: ``n % k == offset`` (``n`` counts optimizer
        updates already done, from 0, so update 0 syncs at offset 0: a no-op when both models start from one
        checkpoint); never when ``every`` is None."""
        return self.every is not None and updates_done % self.every == self.offset
