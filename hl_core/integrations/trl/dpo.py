"""Humanline DPO on TRL's ``DPOTrainer``: the per-token log-ratios are transformed (clipped) before the sums.

TRL 1.16 sums each sequence's per-token log-probs inside ``DPOTrainer._compute_loss`` before any ratio is formed, so
the clip needs that method: :class:`HumanlineDPOTrainer` overrides it with the sigmoid loss over the clipped
per-token log-ratios, ``-logsigmoid(beta * (sum_t d_hl[chosen] - sum_t d_hl[rejected]))``, the pack's DPO.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from trl import DPOTrainer

from .compat import HumanlineTrlSettingError
from .mixin import HumanlineMixin

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


def check_dpo_settings(args) -> None:
    """The DPO settings whose objective the override computes: TRL's standard sigmoid DPO."""
    unsupported = {
        "loss_type": (list(args.loss_type) != ["sigmoid"], "['sigmoid']"),
        "f_divergence_type": (args.f_divergence_type != "reverse_kl", "'reverse_kl'"),
        "ld_alpha": (args.ld_alpha is not None, "None"),
        "use_weighting": (bool(args.use_weighting), "False"),
        "label_smoothing": (args.label_smoothing != 0.0, "0.0"),
    }
    bad = [f"`{name}` (use {fix})" for name, (is_bad, fix) in unsupported.items() if is_bad]
    if bad:
        raise HumanlineTrlSettingError(
            f"HumanlineDPOTrainer computes humanline DPO, the sigmoid loss over summed clipped per-token log-ratios, "
            f"and does not implement these DPOConfig settings: {', '.join(bad)}. Fix: leave them at their defaults, "
            f"or use our trainer (launchers/run.py, `objective.loss_type`) for the other DPO losses."
        )


class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` with humanline clipping (``transform``) and syncing (``schedule``).

    A training set that already holds ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` is used as is (no chat
    template, no EOS added), so the same token ids can be fed to TRL and to another trainer.
    """

    _trl_trainer = "DPOTrainer"

    def __init__(self, *args, **kwargs):
        settings = kwargs.get("args", args[2] if len(args) > 2 else None)
        if settings is not None:
            check_dpo_settings(settings)
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if set(TOKEN_COLUMNS) <= set(dataset.column_names or ()):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        model_kwargs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"],
                        "use_cache": False}
        labels = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
        mask = inputs["completion_mask"][:, 1:]
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
        policy_logps = outputs.log_probs[:, -mask.shape[1]:]
        with torch.no_grad():
            ref_logps = self.ref_model(**model_kwargs, labels=labels, fused_lm_head=True).log_probs[:, -mask.shape[1]:]
        log_ratios, metrics, _ = self._humanline_log_ratios(policy_logps, ref_logps, mask)
        chosen, rejected = log_ratios.sum(-1).chunk(2)
        loss = -F.logsigmoid(self.beta * (chosen - rejected)).mean()

        with torch.no_grad():
            rewards = self.accelerator.gather_for_metrics(self.beta * torch.stack([chosen, rejected]))
            unclamped = self.accelerator.gather_for_metrics(metrics["unclamped_frac"].reshape(1))
        self._metrics[mode]["rewards/chosen"].append(rewards[0].mean().item())
        self._metrics[mode]["rewards/rejected"].append(rewards[1].mean().item())
        self._metrics[mode]["rewards/margins"].append((rewards[0] - rewards[1]).mean().item())
        self._metrics[mode]["rewards/accuracies"].append((rewards[0] > rewards[1]).float().mean().item())
        self._metrics[mode]["humanline/clipped_frac"].append(1.0 - unclamped.mean().item())
        return (loss, outputs) if return_outputs else loss
