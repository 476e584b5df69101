"""Humanline KTO on TRL's ``KTOTrainer``: the per-token log-ratios, and those of the mismatched (KL) rows behind the
reference point ``z0``, are transformed (clipped) before the sums.

TRL 1.16 sums the per-token log-probs inside ``KTOTrainer._compute_loss`` (and ``_compute_kl_logps``), so
:class:`HumanlineKTOTrainer` overrides ``_compute_loss`` with the pack's KTO (``hl_core.objectives.kto``):
``z0 = max(0, sum over ranks of the KL rows' clipped sums / the number of non-zero ones)`` and
``w_D (1 - sigmoid(beta (r - z0)))`` / ``w_U (1 - sigmoid(beta (z0 - r)))`` with ``r = sum_t d_hl[t]``. TRL's own
z0 is the mean of the per-rank mean KL sums; the two agree whenever every KL row's sum is non-zero and the ranks hold
as many rows. TRL's KL rows pair each prompt with the previous example's completion in the batch; a training set
that already holds ``KL_completion_ids`` keeps its own pairing.
"""

from __future__ import annotations

import torch
from trl import KTOTrainer

from hl_core.objectives.kto import kto_loss, kto_reference_point

from .compat import HumanlineTrlSettingError
from .mixin import HumanlineMixin

TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "label", "KL_completion_ids")


class HumanlineKTOTrainer(HumanlineMixin, KTOTrainer):
    """TRL's ``KTOTrainer`` with humanline clipping (``transform``) and syncing (``schedule``); ``loss_type="kto"``.

    A training set that already holds ``prompt_ids``, ``completion_ids``, ``label`` and ``KL_completion_ids`` is used
    as is, so the same token ids (and the same mismatched pairs) can be fed to TRL and to another trainer.
    """

    _trl_trainer = "KTOTrainer"

    def __init__(self, *args, **kwargs):
        settings = kwargs.get("args", args[2] if len(args) > 2 else None)
        if settings is not None and settings.loss_type != "kto":
            raise HumanlineTrlSettingError(
                f"HumanlineKTOTrainer computes humanline KTO, whose reference point z0 comes from the clipped "
                f"mismatched pairs, and does not implement `loss_type={settings.loss_type!r}`. Fix: use "
                "`KTOConfig(loss_type='kto')`."
            )
        super().__init__(*args, **kwargs)

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if set(TOKEN_COLUMNS) <= set(dataset.column_names or ()):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _token_logps(self, model, inputs, prefix=""):
        ids, mask = inputs[f"{prefix}input_ids"], inputs[f"{prefix}completion_mask"]
        labels = ids.masked_fill(mask == 0, -100)
        out = model(input_ids=ids, attention_mask=inputs[f"{prefix}attention_mask"], use_cache=False, labels=labels,
                    fused_lm_head=True)
        return out.log_probs[:, -(ids.shape[1] - 1):], mask[:, 1:]

    def _compute_loss(self, model, inputs, return_outputs):
        mode = "train" if self.model.training else "eval"
        with torch.no_grad():  # z0 first, as the pack does (a sampling transform draws in the same order)
            kl_policy, kl_mask = self._token_logps(model, inputs, "KL_")
            kl_ref, _ = self._token_logps(self.ref_model, inputs, "KL_")
            kl_ratios, _, kl_mask = self._humanline_log_ratios(kl_policy, kl_ref, kl_mask, count=False)
            z0 = kto_reference_point(kl_ratios, kl_mask)
        policy_logps, mask = self._token_logps(model, inputs)
        with torch.no_grad():
            ref_logps, _ = self._token_logps(self.ref_model, inputs)
        log_ratios, metrics, mask = self._humanline_log_ratios(policy_logps, ref_logps, mask)
        loss, kto_metrics = kto_loss(log_ratios, mask, inputs["label"].bool(), z0, beta=self.beta,
                                     desirable_weight=self.desirable_weight,
                                     undesirable_weight=self.undesirable_weight)
        unclamped = self.accelerator.gather_for_metrics(metrics["unclamped_frac"].reshape(1))
        self._metrics[mode]["kl"].append(float(z0))
        self._metrics[mode]["humanline/clipped_frac"].append(1.0 - unclamped.mean().item())
        for key in ("rewards/desirable", "rewards/undesirable"):
            if key in kto_metrics:
                self._metrics[mode][key].append(kto_metrics[key])
        return (loss, None) if return_outputs else loss
