"""What the three humanline trainers share: the settings (keywords or a ``Humanline*Config``), the refusals, the
sync callback, the per-update row, the metrics, the humanline files in TRL's checkpoints and the resume door."""

from __future__ import annotations

import inspect
import os
from typing import Dict

import torch
import torch.nn.functional as F
import trl
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

import hl_core.integrations.trl.checkpoint as ckpt

from .compat import HumanlineTrlSettingError, check_settings, check_trl
from .config import UNSET, describe, settings
from .lora import AdapterReference, ensure_reference_adapter, peft_policy
from .sync import HumanlineSyncCallback

SYNC_FILE, STATE_FILE = ckpt.SYNC_FILE, ckpt.STATE_FILE


def trainer_args(trl_class, args: tuple, kwargs: dict):
    """The ``args=`` TRL's ``trl_class(*args, **kwargs)`` receives, found by binding its signature (None when the
    call does not bind: TRL then raises its own error)."""
    try:
        bound = inspect.signature(trl_class.__init__).bind_partial(None, *args, **kwargs)
    except TypeError:
        return None
    return bound.arguments.get("args")


class HumanlineMixin:
    """Put in front of a TRL trainer class: ``class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer)``.

    Humanline's settings come from the config (``HumanlineDPOConfig`` and its siblings: ``humanline=True`` and the
    ``humanline_*`` fields; ``humanline=False`` is TRL's own trainer) or, with TRL's own config, from two keyword
    arguments on top of the TRL trainer's own:

    * ``transform``: the per-token log-ratio transform (``hl_core.humanline.ClipTransform`` by default, with the
      paper's bounds; ``SampleTransform()`` for humanline sampling, ``NoTransform()`` for none);
    * ``schedule``: the reference sync (``hl_core.humanline.SyncSchedule``; every update by default; ``None`` keeps
      the reference frozen).

    A keyword the config disagrees with is refused (``HumanlineTrlSettingError``). Checkpoints written by TRL's
    ``save_steps`` also hold each rank's sync and transform state (``humanline_sync_rank<r>.pt``) and the settings,
    sync marks and ``humanline_history`` (``humanline_state.json``), checksummed; ``train(resume_from_checkpoint=...)``
    checks the whole checkpoint first (``checkpoint.read_resume``) and restores them.
    """

    _trl_trainer = ""  # the TRL class's name, for the internals check

    def __init__(self, *args, transform=UNSET, schedule=UNSET, **kwargs):
        check_trl(self._trl_trainer)
        config = trainer_args(getattr(trl, self._trl_trainer), args, kwargs)
        chosen = settings(config, transform, schedule)
        if chosen.enabled:
            check_settings(config)
        self.humanline_enabled = chosen.enabled
        self.humanline_transform = chosen.transform
        self._humanline_update: Dict[str, object] = {}
        super().__init__(*args, **kwargs)
        check_trl(self._trl_trainer, instance=self)
        self._humanline_peft = peft_policy(self.model)
        self.humanline_sync = None
        if not self.humanline_enabled:
            return
        self._ensure_reference()
        self.humanline_sync = HumanlineSyncCallback(self, chosen.schedule, rows=True)
        self.add_callback(self.humanline_sync)

    def humanline_settings_record(self) -> dict:
        """What a checkpoint records of this trainer's humanline settings, and a resume compares (the sampling seed
        aside: each rank's generator state is in its own file)."""
        schedule = self.humanline_sync.schedule if self.humanline_sync is not None else None
        return {"humanline": self.humanline_enabled, "transform": describe(self.humanline_transform, seed=False),
                "schedule": repr(schedule)}

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """TRL's ``train``; a resume is checked first, whole (``checkpoint.read_resume``), before transformers reads
        any of it: a refusal changes nothing."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise HumanlineTrlSettingError(
                    f"`resume_from_checkpoint=True` found no `{PREFIX_CHECKPOINT_DIR}-N` folder in `output_dir` "
                    f"({self.args.output_dir}). Fix: point `resume_from_checkpoint` at a checkpoint folder, or leave "
                    "it unset for a fresh run.")
        if resume_from_checkpoint not in (None, False):
            resume = self._agreed(lambda: ckpt.read_resume(self, resume_from_checkpoint), resume_from_checkpoint)
            if self.humanline_sync is not None:
                self.humanline_sync.restore(resume)
        return super().train(resume_from_checkpoint or None, *args, **kwargs)

    def _agreed(self, read, checkpoint):
        """``read()`` on every rank; a refusal on any rank refuses on all (one gather), so no rank trains on alone
        and waits for the others forever."""
        try:
            result, refusal = read(), None
        except HumanlineTrlSettingError as exc:
            result, refusal = None, exc
        if self.args.world_size > 1:
            refused = self.accelerator.gather(torch.tensor([refusal is not None], device=self.accelerator.device))
            ranks = [rank for rank, flag in enumerate(refused.tolist()) if flag]
            if refusal is None and ranks:
                refusal = HumanlineTrlSettingError(
                    f"cannot resume from `{checkpoint}`: rank(s) {ranks} refused it (their message names the file and "
                    "why). Nothing was loaded. Fix: the one their message names.")
        if refusal is not None:
            raise refusal
        return result

    def create_scheduler(self, *args, **kwargs):
        """TRL's; then, under DeepSpeed, the engine's checkpoint loads made weights-only (transformers prepares the
        engine just before and loads a checkpoint into it just after: ``internals``' order contract)."""
        out = super().create_scheduler(*args, **kwargs)
        if self.is_deepspeed_enabled and self.accelerator.deepspeed_engine_wrapped is not None:
            ckpt.install_safe_engine(self.accelerator.deepspeed_engine_wrapped.engine)
        return out

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
        """One row per update: ``update``, ``loss``, ``clipped_frac``, ``synced`` (``HumanlineSyncCallback``); empty
        with humanline off."""
        return self.humanline_sync.history if self.humanline_sync is not None else []

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if self.humanline_enabled:
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
        if not self.humanline_enabled:
            return
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        sync, rows = self.humanline_sync.checkpoint()
        state = getattr(self.humanline_transform, "state_dict", None)
        rows = {"settings": self.humanline_settings_record(), **rows} if self.args.should_save else None
        ckpt.save(folder, self.args.process_index, sync, state() if callable(state) else None, rows)
