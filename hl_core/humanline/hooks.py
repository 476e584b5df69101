"""Running the sync at the right moment: after the update's last backward (and gradient clipping), before the
optimizer step, at gradient-accumulation boundaries only, so the reference receives the pre-update weights.

One object, :class:`ReferenceSync`, serves every loop:

* **your own loop** (plain torch, DDP, FSDP2, DeepSpeed, Megatron-core): call
  ``sync.before_optimizer_step(updates_done)`` between the boundary's backward and ``optimizer.step()`` /
  ``engine.step()``. Under DeepSpeed and Megatron the gradient clipping runs inside ``step``; the sync copies weights,
  not gradients, so calling it just before ``step`` gives the same pre-update weights;
* **a torch optimizer stepped once per update** (plain torch, DDP, FSDP2): ``sync.attach(optimizer)`` registers it as
  the optimizer's step pre-hook, so it fires before every ``optimizer.step()`` and counts updates itself. Do not
  attach it to the optimizer inside a DeepSpeed engine: ZeRO-3 may step one optimizer per parameter sub-group;
* **our trainer**: it runs as the trainer's ``before_optimizer_step`` callback (``hl_core.callbacks``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from .schedule import SyncSchedule
from .sync import ParameterPairs


@dataclass
class SyncRecord:
    """What one call did: ``synced``, the wall-clock ``seconds`` it took and the ``bytes`` it wrote on this rank."""

    synced: bool
    seconds: float = 0.0
    bytes: int = 0


def _synchronize(pairs: ParameterPairs) -> None:
    """Wait for the device's queued work (a timing measures the copy, not the tail of the backward)."""
    for _, tensor, _ in pairs:
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        return


class ReferenceSync:
    """Humanline syncing of one policy/reference pair on a schedule.

    Args:
        pairs: the parameter pairs (:func:`pair_parameters`, :func:`pair_lora_adapters`).
        schedule: when and how far to sync (:class:`SyncSchedule`; default: every update, a full copy).

    Attributes:
        num_syncs: syncs done so far.
        updates_seen: optimizer steps seen through :meth:`attach` (its own update count).
    """

    def __init__(self, pairs: ParameterPairs, schedule: Optional[SyncSchedule] = None):
        self.pairs = pairs
        self.schedule = schedule or SyncSchedule()
        self.num_syncs = 0
        self.updates_seen = 0

    def before_optimizer_step(self, updates_done: int) -> SyncRecord:
        """Sync if the schedule says so before update ``updates_done`` (optimizer updates already done, from 0).

        Call it once per update, after the update's last backward and before its optimizer step.

        Returns:
            A :class:`SyncRecord` (``synced`` False when the schedule skips this update).
        """
        if not self.schedule.due(updates_done):
            return SyncRecord(False)
        _synchronize(self.pairs)
        start = time.perf_counter()
        written = self.pairs.sync(self.schedule.mix)
        _synchronize(self.pairs)
        self.num_syncs += 1
        return SyncRecord(True, time.perf_counter() - start, written)

    def attach(self, optimizer: torch.optim.Optimizer):
        """Run :meth:`before_optimizer_step` as ``optimizer``'s step pre-hook, counting updates itself (use it where
        ``optimizer.step()`` runs once per update).

        Returns:
            The hook's handle (``handle.remove()`` detaches it).
        """

        def hook(_optimizer, _args, _kwargs):
            self.before_optimizer_step(self.updates_seen)
            self.updates_seen += 1

        return optimizer.register_step_pre_hook(hook)
