"""Humanline DPO on TRL's ``DPOTrainer``: TRL's own loss, on per-token log-ratios transformed (clipped) before the sums.

TRL sums each sequence's per-token log-probs inside ``DPOTrainer._compute_loss`` before any ratio is formed.
`HumanlineDPOTrainer` runs TRL's ``_compute_loss`` with the stand-ins of ``fused.FusedPair``: TRL sees
``lp_ref + d_hl`` as the policy's per-token log-probs, so every ``loss_type`` (and their weighted mixes),
``f_divergence_type``, ``ld_alpha``, ``use_weighting``, ``label_smoothing``, the router's auxiliary loss and
``compute_metrics`` behave as TRL's, on the transformed log-ratios. For ``loss_type="sigmoid"`` this is the pack's
DPO, ``-logsigmoid(beta * (sum_t d_hl[chosen] - sum_t d_hl[rejected]))``.
"""

from __future__ import annotations

from trl import DPOTrainer

from .fused import compute_loss_on_pair
from .mixin import HumanlineMixin

TOKEN_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


class HumanlineDPOTrainer(HumanlineMixin, DPOTrainer):
    """TRL's ``DPOTrainer`` with humanline clipping and syncing: set by ``HumanlineDPOConfig``'s fields (with
    ``humanline=False``, TRL's own trainer), or with TRL's ``DPOConfig`` by ``transform=`` and ``schedule=``
    (``HumanlineMixin``).

    A training set that already holds ``prompt_ids``, ``chosen_ids`` and ``rejected_ids`` is used as is (no chat
    template, no EOS added), so the same token ids can be fed to TRL and to another trainer.
    """

    _trl_trainer = "DPOTrainer"

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if set(TOKEN_COLUMNS) <= set(dataset.column_names or ()):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.humanline_enabled:  # `humanline=False`: TRL's own
            return super()._compute_loss(model, inputs, return_outputs)
        return compute_loss_on_pair(self, super()._compute_loss, model, inputs, return_outputs)
