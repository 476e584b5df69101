"""The reference sync on TRL's trainers: ``HumanlineSyncCallback``.

Where it fires (measured by ``tests/test_trl_dpo.py`` with trl 1.16, transformers 5.23, accelerate 1.15,
DeepSpeed 0.19):

* **without DeepSpeed** (one process, DDP): transformers' ``on_pre_optimizer_step`` runs after the update's last
  backward and after ``clip_grad_norm_``, just before ``optimizer.step()``: the pre-update weights. The callback
  syncs there.
* **under DeepSpeed** (accelerate): the optimizer step happens inside ``accelerator.backward``, which calls
  ``engine.backward`` then ``engine.step()`` at the accumulation boundary; ``on_pre_optimizer_step`` fires after it,
  on the post-update weights, and a torch step pre-hook on the optimizer inside the engine fires once per ZeRO
  parameter sub-group, between sub-group updates. So the callback attaches the sync to the policy engine instead
  (``ReferenceSync.attach(engine)``): it runs at the boundary, after the engine's backward, before its step
  (clipping included), with the weights that produced this update's loss.

The copy is ``hl_core.humanline.pair_parameters`` + ``hl_core.humanline.ReferenceSync``: each rank writes
its own shard (ZeRO-3: its partition), nothing is gathered, no collective runs.

One sync per reference: a second ``HumanlineSyncCallback`` on a trainer that has one, or on a reference another
callback syncs (two trainers sharing one reference), is refused; each update would otherwise sync twice.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
from transformers import TrainerCallback

from hl_core.humanline import ReferenceSync, SyncRecord, SyncSchedule, SyncUsageError
from hl_core.humanline.sync import _unwrap

from .checkpoint import Resume, expected_local
from .compat import HumanlineTrlSettingError
from .lora import reference_pairs


class HumanlineSyncCallback(TrainerCallback):
    """Sync ``trainer.ref_model`` with the policy's pre-update weights on ``schedule``, and keep one row per update.

    The humanline trainers add it themselves. On its own it syncs the reference of a stock TRL or transformers
    trainer that has one (``trainer.ref_model``: TRL's ``DPOTrainer``/``KTOTrainer`` with a reference model,
    ``GRPOTrainer`` at ``beta != 0``), with no subclass and no clipping:
    ``trainer.add_callback(HumanlineSyncCallback(trainer, SyncSchedule(every=k)))``. Limits: the reference must have
    the policy's layout (not PEFT's disabled adapter), and log-probs the trainer caches from the reference
    (``precompute_ref_log_probs``, GRPO's ``ref_per_token_logps`` of a generation batch reused over
    ``steps_per_generation``) are as old as the cache, not the sync.

    Args:
        trainer: the trainer (its ``model_wrapped``, ``ref_model``, ``state``, ``accelerator``).
        schedule: when and how far to sync; ``None`` keeps the reference frozen.
        rows: whether the trainer is a humanline trainer that keeps each update's loss and clipped fraction
            (``HumanlineMixin``); otherwise a row holds ``update`` and ``synced`` only.

    Attributes:
        records: one ``hl_core.humanline.SyncRecord`` per update.
        history: one row per update: ``update``, ``loss`` (the update's loss, mean over ranks), ``clipped_frac``
            (counted tokens the transform changed, mean over micro-batches and ranks) and ``synced``.
    """

    def __init__(self, trainer, schedule: Optional[SyncSchedule], rows: bool = False):
        if schedule is not None and not isinstance(schedule, SyncSchedule):
            raise HumanlineTrlSettingError(
                f"HumanlineSyncCallback's `schedule={schedule!r}` is not accepted: it takes a "
                "hl_core.humanline.SyncSchedule, or None for a frozen reference. Fix: pass "
                f"`SyncSchedule(every={schedule if isinstance(schedule, int) else 'k'})`.")
        handler = getattr(trainer, "callback_handler", None)
        if any(isinstance(cb, HumanlineSyncCallback) for cb in getattr(handler, "callbacks", ())):
            raise HumanlineTrlSettingError(
                f"{type(trainer).__name__} already has a HumanlineSyncCallback (a humanline trainer adds its own), "
                "and a second one would sync the reference twice in every update (with `mix=0.5`, 0.75 of the way). "
                "Fix: drop the second callback; give the schedule to the one in place (a humanline trainer's "
                "`schedule=` or its config's `humanline_sync_freq`).")
        self.trainer = trainer
        self.schedule = schedule
        self.rows = rows
        self.sync: Optional[ReferenceSync] = None
        self.records: List[SyncRecord] = []
        self.history: List[dict] = []
        self.synced_updates: List[int] = []
        self._restored: Optional[Resume] = None  # checked by checkpoint.read_resume, applied at train begin
        self._attachment = None  # the engine's step, under DeepSpeed

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        restored, self._restored = self._restored, None
        if self.schedule is not None and self.schedule.every is not None:
            pairs = reference_pairs(trainer.model_wrapped, trainer.ref_model)
            if self.sync is not None:  # a train() before this one: its sync lets go of the reference
                self.sync.close()
            self.sync = self._reference_sync(pairs, state.global_step)
            if restored is not None and restored.sync is not None:  # the moved reference and the counts
                self._load(restored.sync)
            if trainer.is_deepspeed_enabled:
                self._attach_engine(trainer.model_wrapped)
        if restored is not None:
            if restored.transform:  # a SampleTransform's generators (checked by checkpoint.read_resume)
                trainer.humanline_transform.load_state_dict(restored.transform)
            if restored.rows is not None:
                self.synced_updates = [int(n) for n in restored.rows["synced_updates"]]
                self.history = [dict(row) for row in restored.rows["history"]]

    def _reference_sync(self, pairs, updates_done: int) -> ReferenceSync:
        """The sync of these pairs; a reference another live ``ReferenceSync`` drives (another callback's, two
        trainers sharing one reference) is refused in the adapter's words."""
        try:
            return ReferenceSync(pairs, self.schedule, updates_done=updates_done)
        except SyncUsageError as exc:
            raise HumanlineTrlSettingError(
                f"the reference of {type(self.trainer).__name__} is already synced by another HumanlineSyncCallback "
                f"or ReferenceSync (two callbacks on one trainer, or two trainers sharing a reference model), so "
                f"every update would sync it twice ({exc}). Fix: give each trainer its own reference model, or sync "
                f"it from one place only (`schedule=None` on the others).") from None

    def expected_shards(self) -> Dict[str, Optional[torch.Tensor]]:
        """Name -> this rank's reference shard as the sync will save it (None where ZeRO-3 partitions it only when
        training starts): what a checkpoint's sync file must hold (``checkpoint.read_resume``)."""
        trainer = self.trainer
        if trainer.ref_model is not None:
            return {name: expected_local(p, False) for name, p in _unwrap(trainer.ref_model).named_parameters()}
        plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None) if trainer.is_deepspeed_enabled else None
        pending = plugin is not None and plugin.zero_stage == 3 and trainer.model_wrapped is trainer.model
        return {name: expected_local(ref, pending) for name, _, ref in reference_pairs(trainer.model, None)}

    def _load(self, state: dict) -> None:
        try:
            self.sync.load_state_dict(state)
        except ValueError as exc:  # another schedule or sharding layout: one paragraph, not a traceback
            fix = "" if "Fix:" in str(exc) else (" Fix: resume with the number of processes, ZeRO stage and schedule "
                                                "that wrote the checkpoint, or start a fresh run.")
            raise HumanlineTrlSettingError(f"cannot resume the humanline reference from this checkpoint: {exc}.{fix}") \
                from None

    def _attach_engine(self, engine) -> None:
        """The sync first in ``engine.step()`` at an accumulation boundary (``ReferenceSync.attach``; see the module
        docstring)."""
        self._attachment = self.sync.attach(engine)

    def before_optimizer_step(self) -> None:
        """The sync for update ``state.global_step`` (updates done so far, from 0)."""
        update = self.trainer.state.global_step
        self.records.append(self.sync.before_optimizer_step(update))
        if self.records[-1].synced:
            self.synced_updates.append(update)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.sync is not None and self._attachment is None:
            self.before_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
        if self._attachment is not None:  # the attached sync ran inside this update's engine.step()
            ran = self.sync.updates_seen == state.global_step and self.sync.last_record is not None
            self.records.append(self.sync.last_record if ran else SyncRecord(False))
            if ran and self.sync.last_record.synced:
                self.synced_updates.append(state.global_step - 1)
        synced = bool(self.synced_updates) and self.synced_updates[-1] == state.global_step - 1
        if not self.rows:
            self.history.append({"update": state.global_step - 1, "synced": synced})
            return
        trainer = self.trainer
        update, trainer._humanline_update = trainer._humanline_update, {}
        row = [torch.as_tensor(update.get("loss", 0.0), dtype=torch.float64),
               torch.as_tensor(update.get("clipped", 0.0), dtype=torch.float64) / max(update.get("micro", 0), 1)]
        shown = trainer.accelerator.reduce(torch.stack(row).to(trainer.accelerator.device), "mean")
        self.history.append({"update": state.global_step - 1, "loss": shown[0].item(),
                             "clipped_frac": shown[1].item(), "synced": synced})

    def checkpoint(self) -> tuple:
        """What a checkpoint keeps: this rank's ``ReferenceSync.state_dict()`` (the counts and the reference shards
        syncing moved; None without a sync) and, shared by the ranks, the sync marks and the per-update rows."""
        sync = self.sync.state_dict() if self.sync is not None else None
        return sync, {"synced_updates": list(self.synced_updates), "history": list(self.history)}

    def restore(self, resume: Optional[Resume]) -> None:
        """Apply ``resume`` (checked already by ``checkpoint.read_resume``) when training starts."""
        self._restored = resume

    def on_train_end(self, args, state, control, **kwargs):
        if self._attachment is not None:
            self._attachment.remove()
            self._attachment = None
        if self.sync is not None:  # training ended: the reference is free for another sync
            self.sync.close()
