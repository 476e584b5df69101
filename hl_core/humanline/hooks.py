"""Running the sync at the right moment: after the update's last backward (and gradient clipping), before the
optimizer step, at gradient-accumulation boundaries only, so the reference receives the pre-update weights.

One object, ``ReferenceSync``, serves every loop, driven one of two ways (never both: a mix is refused with
``SyncUsageError``, so no update syncs twice):

* **attached** (``sync.attach(x)``): ``x`` is a torch optimizer, a DeepSpeed engine or a Megatron-core optimizer; the
  sync runs before its step, once per update (a DeepSpeed engine: at the accumulation boundary), and counts updates
  itself (``hl_core/humanline/attach.py`` says where each hook sits);
* **called** (``sync.before_optimizer_step(updates_done)``): between the update's last backward and its step. Under
  DeepSpeed and Megatron the gradient clipping runs inside ``step``; the sync copies weights, not gradients, so
  calling it just before ``step`` gives the same pre-update weights. Our trainer calls it this way.

``state_dict()`` / ``load_state_dict()`` carry the update count, the syncs done, the schedule and this rank's reference
shards, so a resumed run syncs at the updates the uninterrupted run would.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from .attach import Attachment, SyncUsageError, hook_into, optimizer_kind
from .schedule import SyncSchedule
from .sync import ParameterPairs


@dataclass
class SyncRecord:
    """What one call did: ``synced``, the wall-clock ``seconds`` it took and the ``bytes`` it wrote on this rank."""

    synced: bool
    seconds: float = 0.0
    bytes: int = 0


def _keywords(schedule: Dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in schedule.items())


def _synchronize(pairs: ParameterPairs) -> None:
    """Wait for the device's queued work (a timing measures the copy, not the tail of the backward)."""
    for _, tensor, _ in pairs:
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        return


class ReferenceSync:
    """Humanline syncing of one policy/reference pair on a schedule.

    Args:
        pairs: the parameter pairs (``pair_parameters``, ``pair_lora_adapters``).
        schedule: when and how far to sync (``SyncSchedule``; default: every update, a full copy).
        updates_done: optimizer updates already done when this object starts (a loop resumed from a checkpoint
            that holds no ``state_dict()`` of it, e.g. TRL's ``state.global_step``).

    Attributes:
        num_syncs: syncs done so far.
        updates_seen: updates this object has been through (attached: counted here; called: ``updates_done + 1`` of
            the last call).
        last_record: the ``SyncRecord`` of the last update (None before the first).
    """

    def __init__(self, pairs: ParameterPairs, schedule: Optional[SyncSchedule] = None, updates_done: int = 0):
        self.pairs = pairs
        self.schedule = schedule or SyncSchedule()
        self.num_syncs = 0
        self.updates_seen = int(updates_done)
        self.last_record: Optional[SyncRecord] = None
        self._attached: Optional[Attachment] = None
        self._called = False

    def state_dict(self, with_reference: bool = True) -> Dict[str, Any]:
        """What a resumed run needs to sync at the updates the uninterrupted run would: the update count, the syncs
        done, the schedule (its phase is the count modulo ``every``) and, with ``with_reference``, this rank's
        reference shards (the weights syncing moved; ``ParameterPairs.reference_shards``).

        Every rank saves its own (the shards differ at ZeRO-3 and under TP/PP), e.g.
        ``torch.save(sync.state_dict(), f"{ckpt}/humanline_rank{rank}.pt")``, and restores it with
        ``sync.load_state_dict(torch.load(path, weights_only=True))`` on the same layout.

        Args:
            with_reference: include this rank's reference shards (CPU copies).

        Returns:
            A dict of ints, floats and CPU tensors (``torch.load(..., weights_only=True)`` reads it back).
        """
        schedule = self.schedule
        state: Dict[str, Any] = {
            "updates_seen": self.updates_seen, "num_syncs": self.num_syncs,
            "schedule": {"every": schedule.every, "offset": schedule.offset, "mix": schedule.mix},
        }
        if with_reference:
            state["reference_shards"] = self.pairs.reference_shards()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``: the counts and, when it holds them, this rank's reference shards.

        Args:
            state: what ``state_dict()`` returned on this rank of a run with the same schedule and layout.

        Raises:
            ValueError: the saved schedule differs from this object's, or the shards do not match its layout.
        """
        saved = dict(state["schedule"])
        mine = {"every": self.schedule.every, "offset": self.schedule.offset, "mix": self.schedule.mix}
        if saved != mine:
            raise ValueError(
                f"the saved ReferenceSync ran with SyncSchedule({_keywords(saved)}) but this one has "
                f"SyncSchedule({_keywords(mine)}): resuming would move the syncs to other updates. Fix: build the "
                f"ReferenceSync with SyncSchedule({_keywords(saved)}), or start a fresh run.")
        if "reference_shards" in state:
            self.pairs.load_reference_shards(state["reference_shards"])
        self.updates_seen, self.num_syncs = int(state["updates_seen"]), int(state["num_syncs"])

    def before_optimizer_step(self, updates_done: int) -> SyncRecord:
        """Sync if the schedule says so before update ``updates_done`` (optimizer updates already done, from 0).

        Call it once per update, after the update's last backward and before its optimizer step (under gradient
        accumulation: at the boundary only).

        Args:
            updates_done: the loop's own update count.

        Returns:
            A ``SyncRecord`` (``synced`` False when the schedule skips this update).

        Raises:
            SyncUsageError: this object is attached (``attach``): the attached hook syncs already.
        """
        if self._attached is not None:
            raise SyncUsageError(
                f"ReferenceSync.before_optimizer_step({updates_done}) was called while the sync is attached to a "
                f"{type(self._attached.target).__name__} ({self._attached.kind}), which syncs before its step "
                "already: this update would sync twice. Fix: drop the manual call and let the attached hook sync, or "
                "call remove() on the handle attach() returned and keep the manual call.")
        self._called = True
        return self._run(int(updates_done))

    def attach(self, target) -> Attachment:
        """Sync before every step of ``target``, once per update, counting updates here (from ``updates_seen``).

        Args:
            target: a torch optimizer (a step pre-hook: plain torch, DDP, FSDP2), a DeepSpeed engine (its ``step`` at
                the gradient-accumulation boundary, ZeRO 0-3), or a Megatron-core optimizer (its ``step``).

        Returns:
            An ``Attachment``; its ``remove()`` detaches the sync.

        Raises:
            SyncUsageError: already attached, or ``before_optimizer_step`` was called on this object.
            TypeError: ``target`` is none of the three.
        """
        if self._attached is not None or self._called:
            how = ("attached to a " + type(self._attached.target).__name__) if self._attached else (
                "called by hand (before_optimizer_step)")
            raise SyncUsageError(
                f"ReferenceSync.attach was called on a sync already {how}: both would sync in one update. Fix: drive "
                "one ReferenceSync one way: either attach it once to the object whose step ends the update, or call "
                "before_optimizer_step(updates_done) yourself, not both.")
        kind = optimizer_kind(target)
        undo = hook_into(target, kind, lambda: self._run(self.updates_seen))
        self._attached = Attachment(target, kind, undo, self._detached)
        return self._attached

    def _detached(self) -> None:
        self._attached = None

    def _run(self, updates_done: int) -> SyncRecord:
        """The sync itself (if due before update ``updates_done``); counts the update."""
        self.updates_seen = updates_done + 1
        record = SyncRecord(False)
        if self.schedule.due(updates_done):
            _synchronize(self.pairs)
            start = time.perf_counter()
            written = self.pairs.sync(self.schedule.mix)
            _synchronize(self.pairs)
            self.num_syncs += 1
            record = SyncRecord(True, time.perf_counter() - start, written)
        self.last_record = record
        return record
