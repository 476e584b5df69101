"""What the three humanline trainers share: the settings, the refusals, the sync callback, the per-update row, the
metrics and the reference's place in TRL's checkpoints."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import torch
import torch.nn.functional as F
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hl_core.humanline import ClipTransform, LogRatioTransform, SyncSchedule

from .compat import HumanlineTrlSettingError, check_settings, check_trl
from .lora import AdapterReference, ensure_reference_adapter, peft_policy
from .sync import HumanlineSyncCallback

SYNC_FILE = "humanline_sync_rank{rank}.pt"  # ReferenceSync.state_dict(): the counts and the reference shards
STATE_FILE = "humanline_state.json"


class HumanlineMixin:
    """Put in front of a TRL trainer class: ``class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer)``.

    Keyword arguments on top of the TRL trainer's own:

    * ``transform``: the per-token log-ratio transform (``hl_core.humanline.ClipTransform`` by default, with the
      paper's bounds; ``SampleTransform()`` for humanline sampling, ``NoTransform()`` for none);
    * ``schedule``: the reference sync (``hl_core.humanline.SyncSchedule``; every update by default; ``None`` keeps
      the reference frozen).

    Checkpoints written by TRL's ``save_steps`` also hold each rank's ``ReferenceSync.state_dict()`` (the moved
    reference's shards and the sync's counts, ``humanline_sync_rank<r>.pt``) and ``humanline_history`` with its sync
    marks (``humanline_state.json``); ``train(resume_from_checkpoint=...)`` restores them.
    """

    _trl_trainer = ""  # the TRL class's name, for the internals check

    def __init__(self, *args, transform: Optional[LogRatioTransform] = None,
                 schedule: Optional[SyncSchedule] = SyncSchedule(every=1), **kwargs):
        check_trl(self._trl_trainer)
        self.humanline_transform = ClipTransform() if transform is None else transform
        settings = kwargs.get("args", args[2] if len(args) > 2 else None)
        check_settings(settings)
        self._humanline_update: Dict[str, object] = {}
        super().__init__(*args, **kwargs)
        self._humanline_peft = peft_policy(self.model)
        self._ensure_reference()
        self.humanline_sync = HumanlineSyncCallback(self, schedule, rows=True)
        self.add_callback(self.humanline_sync)

    def _ensure_reference(self) -> None:
        """A PEFT policy's reference: the frozen ``ref`` adapter (``lora.ensure_reference_adapter``)."""
        if self._humanline_peft is not None:
            ensure_reference_adapter(type(self).__name__, self._humanline_peft)

    def _humanline_reference(self, policy):
        """The reference to call on the policy's inputs: ``ref_model``, or a PEFT ``policy`` running its ``ref``
        adapter (``lora.AdapterReference``)."""
        return AdapterReference(policy) if self._humanline_peft is not None else self.ref_model

    @property
    def humanline_history(self):
        """One row per update: ``update``, ``loss``, ``clipped_frac``, ``synced`` (``HumanlineSyncCallback``)."""
        return self.humanline_sync.history

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        update = self._humanline_update
        update["loss"] = update.get("loss", 0.0) + loss.detach().to(torch.float64)
        return loss

    def _humanline_log_ratios(self, policy_logps, ref_logps, mask, lead: int = 1):
        """The transform.

        TRL's per-token log-probs are shifted (``[B, T - 1]``: position ``t`` scores token ``t + 1``); ``lead``
        zero columns in front give the layout of ``input_ids`` (``[B, T]``, 0 at position 0), which our trainer
        uses, so that a sampling transform draws its random numbers for the same positions. Sums are unchanged.
        """
        if lead:
            policy_logps, ref_logps, mask = (F.pad(x, (lead, 0)) for x in (policy_logps, ref_logps, mask))
        log_ratios, metrics = self.humanline_transform(policy_logps, ref_logps, mask)
        return log_ratios, metrics, mask

    def _humanline_count(self, metrics) -> None:
        """Keep the fraction of counted tokens the transform changed: for this update's row and TRL's metrics (a
        tensor, made a float when TRL logs, so no host sync per micro-batch)."""
        clipped = (1.0 - metrics["unclamped_frac"]).detach().reshape(1)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["humanline/clipped_frac"].append(self.accelerator.gather(clipped).mean())
        if mode == "train":
            update = self._humanline_update
            update["clipped"] = update.get("clipped", 0.0) + clipped[0]
            update["micro"] = update.get("micro", 0) + 1

    def log(self, logs, *args, **kwargs):
        for store in self._metrics.values():  # TRL averages the stored values into logs that go to JSON
            for key, values in store.items():
                store[key] = [v.item() if isinstance(v, torch.Tensor) else v for v in values]
        return super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        sync, rows = self.humanline_sync.checkpoint()
        if sync is not None:
            torch.save(sync, os.path.join(folder, SYNC_FILE.format(rank=self.args.process_index)))
        if self.args.should_save:
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump(rows, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        sync_file = os.path.join(checkpoint, SYNC_FILE.format(rank=self.args.process_index))
        rows_file = os.path.join(checkpoint, STATE_FILE)
        schedule = self.humanline_sync.schedule
        if not os.path.exists(sync_file) and schedule is not None and schedule.every is not None:
            raise HumanlineTrlSettingError(
                f"`resume_from_checkpoint={checkpoint}` holds no `{os.path.basename(sync_file)}`: the moved "
                "reference and the sync's counts that this rank needs (the checkpoint was written by a trainer "
                "without humanline syncing, or by fewer processes), so the run would resume against the initial "
                "reference and sync on other updates. Fix: resume from a checkpoint this humanline trainer wrote, "
                "with the same number of processes, or start a fresh run."
            )
        sync = torch.load(sync_file, map_location="cpu", weights_only=True) if os.path.exists(sync_file) else None
        rows = None
        if os.path.exists(rows_file):
            with open(rows_file) as f:
                rows = json.load(f)
        self.humanline_sync.restore(sync, rows)
