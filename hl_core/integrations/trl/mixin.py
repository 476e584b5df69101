"""What the three humanline trainers share: the settings, the refusals, the sync callback and the per-update row."""

from __future__ import annotations

from typing import Dict, Optional

import torch
import torch.nn.functional as F

from hl_core.humanline import ClipTransform, LogRatioTransform, NoTransform, SyncSchedule

from .compat import HumanlineTrlSettingError, check_settings, check_trl
from .sync import HumanlineSyncCallback


class HumanlineMixin:
    """Put in front of a TRL trainer class: ``class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer)``.

    Keyword arguments on top of the TRL trainer's own:

    * ``transform``: the per-token log-ratio transform (``hl_core.humanline.ClipTransform`` by default, with
      the paper's bounds; ``SampleTransform()`` for humanline sampling, ``NoTransform()`` for none);
    * ``schedule``: the reference sync (``hl_core.humanline.SyncSchedule``; every update by default; ``None``
      keeps the reference frozen).
    """

    _trl_trainer = ""  # the TRL class's name, for the internals check

    def __init__(self, *args, transform: Optional[LogRatioTransform] = None,
                 schedule: Optional[SyncSchedule] = SyncSchedule(every=1), **kwargs):
        check_trl(self._trl_trainer)
        self.humanline_transform = ClipTransform() if transform is None else transform
        settings = kwargs.get("args", args[2] if len(args) > 2 else None)
        check_settings(settings, clipping=not isinstance(self.humanline_transform, NoTransform))
        self._humanline_update: Dict[str, object] = {}
        super().__init__(*args, **kwargs)
        self._ensure_reference()
        if getattr(self, "ref_model", None) is None:
            raise HumanlineTrlSettingError(
                f"{type(self).__name__} has no reference model: TRL keeps none for a PEFT model (it disables the "
                "adapter instead), but humanline syncs and clips against a separate reference, and the TRL adapter "
                "does not cover PEFT. Fix: train the full model with `ref_model=` a second copy of it (or leave "
                "`ref_model` out and TRL loads one), or use our trainer's LoRA (`model.lora`, whose reference "
                "adapter is synced)."
            )
        self.humanline_sync = HumanlineSyncCallback(self, schedule)
        self.add_callback(self.humanline_sync)

    def _ensure_reference(self) -> None:
        """Build a reference where the TRL trainer keeps none (GRPO at ``beta=0``)."""

    @property
    def humanline_history(self):
        """One row per update: ``update``, ``loss``, ``clipped_frac``, ``synced`` (``HumanlineSyncCallback``)."""
        return self.humanline_sync.history

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        update = self._humanline_update
        update["loss"] = update.get("loss", 0.0) + loss.detach().to(torch.float64)
        return loss

    def _humanline_log_ratios(self, policy_logps, ref_logps, mask, count: bool = True, lead: int = 1):
        """The transform, with the fraction of counted tokens it changed kept for this update's row (``count``).

        TRL's per-token log-probs are shifted (``[B, T - 1]``: position ``t`` scores token ``t + 1``); ``lead``
        zero columns in front give the layout of ``input_ids`` (``[B, T]``, 0 at position 0), which our trainer
        uses, so that a sampling transform draws its random numbers for the same positions. Sums are unchanged.
        """
        if lead:
            policy_logps, ref_logps, mask = (F.pad(x, (lead, 0)) for x in (policy_logps, ref_logps, mask))
        log_ratios, metrics = self.humanline_transform(policy_logps, ref_logps, mask)
        if count and self.model.training:
            update = self._humanline_update
            update["clipped"] = update.get("clipped", 0.0) + (1.0 - metrics["unclamped_frac"]).detach()
            update["micro"] = update.get("micro", 0) + 1
        return log_ratios, metrics, mask
