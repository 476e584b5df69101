"""The reference sync on TRL's trainers: :class:`HumanlineSyncCallback`.

Where it fires (measured by ``tests/test_trl_dpo.py`` with trl 1.16, transformers 5.23, accelerate 1.15,
DeepSpeed 0.19):

* **without DeepSpeed** (one process, DDP): transformers' ``on_pre_optimizer_step`` runs after the update's last
  backward and after ``clip_grad_norm_``, just before ``optimizer.step()``: the pre-update weights. The callback
  syncs there.
* **under DeepSpeed** (accelerate): the optimizer step happens inside ``accelerator.backward``, which calls
  ``engine.backward`` then ``engine.step()`` at the accumulation boundary; ``on_pre_optimizer_step`` fires after it,
  on the post-update weights, and a torch step pre-hook on the optimizer inside the engine fires once per ZeRO
  parameter sub-group, between sub-group updates. So the callback wraps the policy engine's ``step`` instead: the
  sync runs at the boundary, after the engine's backward, before its step (clipping included), with the weights
  that produced this update's loss.

The copy is :func:`hl_core.humanline.pair_parameters` + :class:`hl_core.humanline.ReferenceSync`: each rank writes
its own shard (ZeRO-3: its partition), nothing is gathered, no collective runs.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from transformers import TrainerCallback

from hl_core.humanline import ReferenceSync, SyncRecord, SyncSchedule, pair_parameters


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
        self.trainer = trainer
        self.schedule = schedule
        self.rows = rows
        self.sync: Optional[ReferenceSync] = None
        self.records: List[SyncRecord] = []
        self.history: List[dict] = []
        self.synced_updates: List[int] = []
        self._num_syncs = 0  # restored from a checkpoint before the sync exists
        self._engine, self._engine_step = None, None

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if self.schedule is None or self.schedule.every is None:
            return
        self.sync = ReferenceSync(pair_parameters(trainer.model_wrapped, trainer.ref_model), self.schedule)
        self.sync.num_syncs = self._num_syncs
        if trainer.is_deepspeed_enabled:
            self._wrap_engine_step(trainer.model_wrapped)

    def _wrap_engine_step(self, engine) -> None:
        """Run the sync first in ``engine.step()`` at an accumulation boundary (see the module docstring)."""
        original = engine.step

        def step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                self.before_optimizer_step()
            return original(*args, **kwargs)

        engine.step = step
        self._engine, self._engine_step = engine, original

    def before_optimizer_step(self) -> None:
        """The sync for update ``state.global_step`` (updates done so far, from 0)."""
        update = self.trainer.state.global_step
        self.records.append(self.sync.before_optimizer_step(update))
        if self.records[-1].synced:
            self.synced_updates.append(update)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.sync is not None and self._engine is None:
            self.before_optimizer_step()

    def on_step_end(self, args, state, control, **kwargs):
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

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the syncs done, the updates they ran before and the per-update rows."""
        num_syncs = self.sync.num_syncs if self.sync is not None else self._num_syncs
        return {"num_syncs": num_syncs, "synced_updates": list(self.synced_updates), "history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        """The inverse of ``state_dict`` (before ``train`` resumes)."""
        self._num_syncs = int(state["num_syncs"])
        if self.sync is not None:
            self.sync.num_syncs = self._num_syncs
        self.synced_updates = [int(n) for n in state["synced_updates"]]
        self.history = [dict(row) for row in state["history"]]

    def on_train_end(self, args, state, control, **kwargs):
        if self._engine is not None:
            self._engine.step = self._engine_step
            self._engine = None
