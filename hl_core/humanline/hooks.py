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
shards, with a checksum, so a resumed run syncs at the updates the uninterrupted run would; a load checks everything
before it changes anything.

One sync per reference: a second ``ReferenceSync`` on reference tensors a live one drives is refused
(``SyncUsageError``; ``close()`` releases them), and so is a sync whose paired parameters a module no longer holds
(replaced since pairing, e.g. by ``load_state_dict(..., assign=True)``), instead of reporting ``synced=True``.
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch

from ..errors import HumanlineStateError, SyncUsageError
from .attach import Attachment, hook_into, optimizer_kind
from .contract import describe, instance_of, whole_number
from .schedule import SyncSchedule
from .sync import ParameterPairs

STATE_KEYS = ("updates_seen", "num_syncs", "schedule", "checksum")
SHARD_KEYS = ("reference_shards", "shard_checksums")  # unless left out (``with_reference=False``)
SCHEDULE_KEYS = ("every", "offset", "mix")
# id(reference tensor) -> (the tensor, the ReferenceSync that drives it), both weakly: one sync per reference
_DRIVEN: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


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


def _digest(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    return f"sha256:{digest.hexdigest()}"


def state_checksum(state: Dict[str, Any]) -> str:
    """``sha256:<hex>`` of a sync state's counts and schedule: what ``state_dict`` writes as ``checksum``."""
    head = {key: state[key] for key in ("updates_seen", "num_syncs", "schedule")}
    return _digest(json.dumps(head, sort_keys=True).encode())


def shard_checksum(shard: torch.Tensor) -> str:
    """``sha256:<hex>`` of one reference shard's dtype, shape and bytes: what ``state_dict`` writes per shard in
    ``shard_checksums``, so a flipped byte is refused."""
    data = shard.detach().cpu().reshape(-1).contiguous()
    return _digest(json.dumps([str(shard.dtype), list(shard.shape)]).encode(),
                   data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")


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
        where = "ReferenceSync()"
        self.pairs = instance_of(where, "pairs", pairs, ParameterPairs, "a ParameterPairs",
                                       "pass pair_parameters(policy, reference) (or pair_lora_adapters(model))")
        self.schedule = schedule if schedule is not None else SyncSchedule()
        instance_of(where, "schedule", self.schedule, SyncSchedule, "a SyncSchedule instance or None",
                          "pass e.g. SyncSchedule(every=2)")
        self.updates_seen = whole_number(where, "updates_done", updates_done,
                                           "pass the optimizer updates already done (0 for a fresh run)", low=0)
        self.num_syncs = 0
        self.last_record: Optional[SyncRecord] = None
        self._attached: Optional[Attachment] = None
        self._called = False
        self._closed = False
        self._claim()

    def _claim(self) -> None:
        """Record this object as the one sync of its reference tensors; refuse if another live one drives them."""
        for name, _, reference in self.pairs:
            entry = _DRIVEN.get(id(reference))
            owner = entry[1]() if entry is not None and entry[0]() is reference else None
            if owner is not None and owner is not self:
                raise SyncUsageError(
                    f"`ReferenceSync()`: the reference parameter `{name}` is already driven by another ReferenceSync "
                    f"(or a HumanlineSyncCallback), created earlier and still alive: both would sync it in one update "
                    f"(with mix=0.5 the reference would move 0.75 of the way). Nothing was changed. Fix: keep one "
                    f"ReferenceSync per reference, or call close() on the other one first.")
        for _, _, reference in self.pairs:
            _DRIVEN[id(reference)] = (weakref.ref(reference), weakref.ref(self))
        for key in [k for k, (tensor, owner) in _DRIVEN.items() if tensor() is None or owner() is None]:
            del _DRIVEN[key]  # entries of tensors or syncs gone since

    def close(self) -> None:
        """Detach (if attached) and release the reference, so that another ``ReferenceSync`` may drive it. This object
        must not be used afterwards."""
        if self._attached is not None:
            self._attached.remove()
        for _, _, reference in self.pairs:
            entry = _DRIVEN.get(id(reference))
            if entry is not None and entry[1]() is self:
                del _DRIVEN[id(reference)]
        self._closed = True

    def state_dict(self, with_reference: bool = True) -> Dict[str, Any]:
        """What a resumed run needs to sync at the updates the uninterrupted run would: the update count, the syncs
        done, the schedule (its phase is the count modulo ``every``), with ``with_reference`` this rank's reference
        shards (the weights syncing moved; ``ParameterPairs.reference_shards``), and a checksum of it all.

        Every rank saves its own (the shards differ at ZeRO-3 and under TP/PP), e.g.
        ``torch.save(sync.state_dict(), f"{ckpt}/humanline_rank{rank}.pt")``, and restores it with
        ``sync.load_state_dict(load_checkpoint_file(path))`` on the same layout.

        Args:
            with_reference: include this rank's reference shards (CPU copies).

        Returns:
            A dict: ``updates_seen`` and ``num_syncs`` (ints), ``schedule`` (``every``, ``offset``, ``mix``) and
            their ``checksum`` (``sha256:<hex>``); with ``with_reference``, ``reference_shards`` (name -> CPU tensor)
            and ``shard_checksums`` (name -> ``sha256:<hex>``). ``torch.load(..., weights_only=True)`` reads it back.
            A state without ``reference_shards`` loads the counts only (the reference stays as it is).
        """
        self._check_open("state_dict")
        self.pairs.check_current("ReferenceSync.state_dict")
        schedule = self.schedule
        state: Dict[str, Any] = {
            "updates_seen": self.updates_seen, "num_syncs": self.num_syncs,
            "schedule": {"every": schedule.every, "offset": schedule.offset, "mix": schedule.mix},
        }
        state["checksum"] = state_checksum(state)
        if with_reference:
            state["reference_shards"] = self.pairs.reference_shards()
            state["shard_checksums"] = {name: shard_checksum(t) for name, t in state["reference_shards"].items()}
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``: the counts and, when it holds them, this rank's reference shards. Everything is
        checked before anything changes (keys, types, the schedule, the shards' names, shapes and dtypes, the
        checksum, the shards' finiteness), so a refusal leaves the sync and the reference as they were.

        Args:
            state: what ``state_dict()`` returned on this rank of a run with the same schedule and layout.

        Raises:
            HumanlineStateError: a key missing or unknown, a value of the wrong type, another schedule, a checksum
                that does not match (a damaged file), shards of another layout or dtype, or non-finite shards.
        """
        self._check_open("load_state_dict")
        where = "ReferenceSync.load_state_dict"
        fix = "pass what state_dict() returned on this rank of a run with the same schedule and layout"
        _check_state_shape(where, state, fix)
        saved = dict(state["schedule"])
        mine = {"every": self.schedule.every, "offset": self.schedule.offset, "mix": self.schedule.mix}
        if saved != mine:
            raise HumanlineStateError(
                f"`{where}`: the saved ReferenceSync ran with SyncSchedule({_keywords(saved)}) but this one has "
                f"SyncSchedule({_keywords(mine)}): resuming would move the syncs to other updates. Nothing was "
                f"loaded. Fix: build the ReferenceSync with SyncSchedule({_keywords(saved)}), or start a fresh run.")
        if "reference_shards" in state:  # names, shapes, dtypes: another layout is named as such
            self.pairs.check_reference_shards(state["reference_shards"], where, finite=False)
        damaged = [] if state["checksum"] == state_checksum(state) else ["the counts and schedule"]
        if "reference_shards" in state:
            checksums = state.get("shard_checksums")
            damaged += [f"`{name}`" for name, shard in sorted(state["reference_shards"].items())
                        if not isinstance(checksums, dict) or checksums.get(name) != shard_checksum(shard)]
        if damaged:
            raise HumanlineStateError(
                f"`{where}`: the state's checksum does not match its contents ({', '.join(damaged[:3])}): the file "
                "was damaged (or edited) after state_dict() wrote it. Nothing was loaded. Fix: resume from an intact "
                "copy of the checkpoint, or start a fresh run.")
        if "reference_shards" in state:
            self.pairs.check_reference_shards(state["reference_shards"], where)
        self.pairs.check_current(where)
        if "reference_shards" in state:
            self.pairs.load_reference_shards(state["reference_shards"])
        self.updates_seen, self.num_syncs = state["updates_seen"], state["num_syncs"]

    def before_optimizer_step(self, updates_done: int) -> SyncRecord:
        """Sync if the schedule says so before update ``updates_done`` (optimizer updates already done, from 0).

        Call it once per update, after the update's last backward and before its optimizer step (under gradient
        accumulation: at the boundary only).

        Args:
            updates_done: the loop's own update count.

        Returns:
            A ``SyncRecord`` (``synced`` False when the schedule skips this update).

        Raises:
            SyncUsageError: this object is attached (``attach``): the attached hook syncs already; or a paired
                parameter was replaced since pairing.
            HumanlineUsageError: ``updates_done`` is not a whole number ``>= 0``.
        """
        self._check_open("before_optimizer_step")
        updates_done = whole_number("ReferenceSync.before_optimizer_step", "updates_done", updates_done,
                                      "pass the loop's count of optimizer updates already done (0, 1, 2, ...)", low=0)
        if self._attached is not None:
            raise SyncUsageError(
                f"ReferenceSync.before_optimizer_step({updates_done}) was called while the sync is attached to a "
                f"{type(self._attached.target).__name__} ({self._attached.kind}), which syncs before its step "
                "already: this update would sync twice. Fix: drop the manual call and let the attached hook sync, or "
                "call remove() on the handle attach() returned and keep the manual call.")
        self._called = True
        return self._run(updates_done)

    def attach(self, target) -> Attachment:
        """Sync before every step of ``target``, once per update, counting updates here (from ``updates_seen``).

        Args:
            target: a torch optimizer (a step pre-hook: plain torch, DDP, FSDP2), a DeepSpeed engine (its ``step`` at
                the gradient-accumulation boundary, ZeRO 0-3), or a Megatron-core optimizer (its ``step``).

        Returns:
            An ``Attachment``; its ``remove()`` detaches the sync.

        Raises:
            SyncUsageError: already attached, or ``before_optimizer_step`` was called on this object.
            HumanlineUsageError: ``target`` is none of the three.
        """
        self._check_open("attach")
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

    def _check_open(self, method: str) -> None:
        if self._closed:
            raise SyncUsageError(f"`ReferenceSync.{method}` was called after close(). Fix: build a new ReferenceSync "
                                 "from the pairs.")

    def _run(self, updates_done: int) -> SyncRecord:
        """The sync itself (if due before update ``updates_done``); counts the update."""
        self.pairs.check_current(f"ReferenceSync (update {updates_done})")
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


def _check_state_shape(where: str, state, fix: str) -> None:
    """A sync state's keys and the types of its values (``HumanlineStateError`` naming the first problem)."""
    if not isinstance(state, dict):
        raise HumanlineStateError(f"`{where}`: `state` must be the dict state_dict() returns, got "
                                  f"{describe(state)}. Nothing was loaded. Fix: {fix}.")
    missing = [key for key in STATE_KEYS if key not in state]
    unknown = sorted(map(str, set(state) - set(STATE_KEYS) - set(SHARD_KEYS)))
    if missing or unknown:
        older = (" (a state written before checksums were added has no `checksum`: start a fresh run)"
                 if missing == ["checksum"] else "")
        raise HumanlineStateError(f"`{where}`: the state lacks {missing} and holds unknown keys {unknown}{older}. "
                                  f"Nothing was loaded. Fix: {fix}.")
    counts = [state["updates_seen"], state["num_syncs"]]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in counts) or counts[1] > counts[0]:
        raise HumanlineStateError(f"`{where}`: `updates_seen` and `num_syncs` must be whole numbers with 0 <= "
                                  f"num_syncs <= updates_seen, got {counts}. Nothing was loaded. Fix: {fix}.")
    schedule = state["schedule"]
    if not isinstance(schedule, dict) or sorted(map(str, schedule)) != sorted(SCHEDULE_KEYS) or not all(
            value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
            for value in schedule.values()):
        raise HumanlineStateError(f"`{where}`: `schedule` must be a dict of {list(SCHEDULE_KEYS)} (numbers), got "
                                  f"{describe(schedule)}. Nothing was loaded. Fix: {fix}.")
    if not isinstance(state["checksum"], str):
        raise HumanlineStateError(f"`{where}`: `checksum` must be the string state_dict() writes, got "
                                  f"{describe(state['checksum'])}. Nothing was loaded. Fix: {fix}.")
    shards = state.get("reference_shards", {})
    if not isinstance(shards, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in shards.items()):
        raise HumanlineStateError(f"`{where}`: `reference_shards` must be a dict of name -> tensor, got "
                                  f"{describe(shards)}. Nothing was loaded. Fix: {fix}.")
