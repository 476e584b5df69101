"""Humanline KTO on TRL's ``KTOTrainer``: TRL's own loss, on per-token log-ratios transformed (clipped) before the sums,
those of the mismatched (KL) rows behind the reference point included.

`HumanlineKTOTrainer` runs TRL's ``_compute_loss`` with the stand-ins of ``fused.FusedPair``: TRL sees
``lp_ref + d_hl`` as the policy's per-token log-probs, for the completions and for the KL rows, so TRL's ``kl``
(``max(0, mean over ranks of the mean KL sums)``, here of clipped KL log-ratios), both ``loss_type`` values, the
desirable/undesirable weights, the router's auxiliary loss and ``compute_metrics`` behave as TRL's. With
``loss_type="kto"`` this is the pack's KTO whenever every KL row's sum is non-zero and the ranks hold as many rows (the
pack divides the sum over ranks by the number of non-zero KL sums). TRL's KL rows pair each prompt with the previous
example's completion in the batch; a training set that already holds ``KL_completion_ids`` keeps its own pairing.
"""

from __future__ import annotations

from trl import KTOTrainer

from .fused import compute_loss_on_pair
from .mixin import HumanlineMixin

TOKEN_COLUMNS = ("prompt_ids", "completion_ids", "label", "KL_completion_ids")


class HumanlineKTOTrainer(HumanlineMixin, KTOTrainer):
    """TRL's ``KTOTrainer`` with humanline clipping and syncing: set by ``HumanlineKTOConfig``'s fields (with
    ``humanline=False``, TRL's own trainer), or with TRL's ``KTOConfig`` by ``transform=`` and ``schedule=``
    (``HumanlineMixin``).

    A training set that already holds ``prompt_ids``, ``completion_ids``, ``label`` and ``KL_completion_ids`` is used
    as is, so the same token ids (and the same mismatched pairs) can be fed to TRL and to another trainer.
    """

    _trl_trainer = "KTOTrainer"

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        if set(TOKEN_COLUMNS) <= set(dataset.column_names or ()):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _compute_loss(self, model, inputs, return_outputs):
        if not self.humanline_enabled:  # `humanline=False`: TRL's own
            return super()._compute_loss(model, inputs, return_outputs)
        return compute_loss_on_pair(self, super()._compute_loss, model, inputs, return_outputs)
