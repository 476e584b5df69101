"""When the reference is synced, and how far: every ``k`` optimizer updates, at an offset, by a mix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def should_sync(updates_done: int, sync_every: Optional[int], offset: int = 0) -> bool:
    """Whether to sync before update ``n``: ``n % k == offset`` (``n`` = optimizer updates already done, so update 0
    syncs at offset 0: a no-op when both models start from one checkpoint); never when ``k`` is None."""
    return sync_every is not None and updates_done % sync_every == offset


def mix_into(reference: torch.Tensor, policy: torch.Tensor, mix: float) -> None:
    """In place, elementwise: ``reference = mix * policy + (1 - mix) * reference``, so any shard of a parameter
    mixes as the whole would.

    ``mix == 1`` is a plain copy (bit for bit); otherwise ``torch.lerp``, which rounds once in the tensor's dtype
    (``mul_`` then ``add_`` would round twice: in bf16, a drift of up to an ulp of the weight per sync).

    Args:
        reference: the tensor written.
        policy: the tensor read.
        mix: in ``(0, 1]``.

    Shape:
        ``reference`` and ``policy`` alike.
    """
    if mix == 1.0:
        reference.copy_(policy)
    else:
        reference.lerp_(policy, mix)


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
        """Whether the reference syncs before update ``updates_done`` (counted from 0)."""
        return should_sync(updates_done, self.every, self.offset)
