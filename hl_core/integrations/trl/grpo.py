"""Humanline GRPO on TRL's ``GRPOTrainer``: TRL's own loss, with the ratio taken against the synced reference and its
per-token log-ratio transformed (clipped) before ``exp()``, then PPO-clipped (so clipped twice), as the method says.

`HumanlineGRPOTrainer` runs TRL's ``_compute_loss`` with, for the policy's per-token log-probs,
``lp_ref + d_hl`` (``d_hl = T(lp_pol - lp_ref)``, ``lp_ref`` the synced reference's, computed at loss time), and the
reference's log-probs as TRL's ``old_per_token_logps``. So TRL's ratio is ``exp(d_hl)``, and every ``loss_type``,
``importance_sampling_level``, the entropy bonus (static and adaptive), ``top_entropy_quantile``, the router's
auxiliary loss and the metrics are TRL's own. It always keeps a reference model (TRL keeps none at ``beta=0``):
``ref_model=`` or a copy of the policy.

Two of TRL's terms read the old policy, which humanline replaces by the synced reference:

* TRL's KL term (``beta != 0``) is given the reference log-probs that make it ``k3`` of the *unclamped* log-ratio,
  ``k3 = exp(lp_ref - lp_pol) - (lp_ref - lp_pol) - 1``, as the method says; with ``use_bias_correction_kl=False``
  that is the term, ``beta * k3`` (the pack's GRPO); with ``use_bias_correction_kl=True`` (TRL's default) TRL weights
  it by its importance ratio, here humanline's ``exp(d_hl)``: ``beta * k3 * exp(d_hl)``.
* ``off_policy_mask_threshold`` (DeepSeek-V3.2's off-policy sequence mask) measures the drift against the synced
  reference: a sequence with a negative advantage is dropped when its mean ``lp_ref - lp_pol`` (unclamped) exceeds
  the threshold.

Offline groups ("rollouts fed identically"): a training set whose rows hold ``prompt_ids``, ``completion_ids`` and
``score`` is read in order, ``num_generations`` consecutive rows (one prompt) per group, with no generation; the
advantages are the pack's ``group_advantages`` (population std, ``advantage_eps``). Other rows go through TRL's own
generation and reward functions (and TRL's advantages).
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import SequentialSampler
from trl import GRPOTrainer
from trl.models.utils import prepare_deepspeed
from trl.trainer import utils as trl_utils

from hl_core.objectives.grpo import group_advantages

from .compat import fused_head_available
from .mixin import HumanlineMixin

OFFLINE_COLUMNS = ("prompt_ids", "completion_ids", "score")


def _pad(rows, value, side):
    width = max(len(r) for r in rows)
    return torch.tensor([([value] * (width - len(r)) if side == "left" else []) + list(r)
                         + ([value] * (width - len(r)) if side == "right" else []) for r in rows])


def _scores_in_the_data(completions, **kwargs):
    raise AssertionError("offline groups carry their scores: nothing is generated or scored")


class HumanlineGRPOTrainer(HumanlineMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with humanline clipping and syncing: set by ``HumanlineGRPOConfig``'s fields (with
    ``humanline=False``, TRL's own trainer), or with TRL's ``GRPOConfig`` by ``transform=`` and ``schedule=``
    (``HumanlineMixin``).

    Extra keyword arguments: ``ref_model`` (the reference; default: a copy of the policy) and ``advantage_eps``
    (offline groups' advantages, default 1e-4). Offline groups need no reward function (``reward_funcs=[]``).
    """

    _trl_trainer = "GRPOTrainer"

    def __init__(self, *args, ref_model=None, advantage_eps: float = 1e-4, **kwargs):
        self.advantage_eps = advantage_eps
        self._humanline_ref = ref_model
        self._humanline_pending = None
        if not kwargs.get("reward_funcs", True) and self._offline(kwargs.get("train_dataset")):
            kwargs["reward_funcs"] = [_scores_in_the_data]  # offline groups: TRL wants a reward source all the same
        super().__init__(*args, **kwargs)

    def _ensure_reference(self) -> None:
        """The reference: the policy's ``ref`` adapter (PEFT), else ``ref_model=`` when given (in place of the one
        TRL loads from the policy's path at ``beta != 0``), else TRL's, else a copy of the policy."""
        if self._humanline_peft is not None:  # the reference is the policy's `ref` adapter
            super()._ensure_reference()
        elif self._humanline_ref is not None or self.ref_model is None:
            self.ref_model = self._build_reference(self._humanline_ref)
        self._humanline_ref = None

    def _build_reference(self, ref_model):
        """The reference TRL builds at ``beta != 0``, here at any beta: prepared as TRL prepares its own. Under
        ZeRO-3 the policy may be partitioned already (loaded under ``zero.Init``), so the reference is loaded as TRL
        loads its own, from the policy's checkpoint; otherwise it is a copy of the policy."""
        ref = ref_model
        if ref is None and self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            ref = trl_utils.create_model_from_path(trl_utils.get_config_model_id(self.model.config),
                                                   dtype=self.model.dtype,
                                                   attn_implementation=self.model.config._attn_implementation)
        elif ref is None:
            ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        if self.args.disable_dropout:
            trl_utils.disable_dropout_in_model(ref)
        if fused_head_available():  # trl 1.14: GRPOTrainer takes the log-probs from the logits, no fused head
            trl_utils.add_fused_lm_head(ref, temperature=self.temperature,
                                        cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        if self.is_deepspeed_enabled:
            return prepare_deepspeed(ref, self.accelerator)
        return self.accelerator.prepare_model(ref, evaluation_mode=True)

    def _offline(self, dataset) -> bool:
        return dataset is not None and set(OFFLINE_COLUMNS) <= set(getattr(dataset, "column_names", None) or ())

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        if self._offline(self.train_dataset):
            self._signature_columns = list(self._signature_columns) + list(OFFLINE_COLUMNS)

    def _get_train_sampler(self, dataset=None):
        dataset = self.train_dataset if dataset is None else dataset
        if self._offline(dataset):  # each row once, in order: the groups are in the data
            return SequentialSampler(dataset)
        return super()._get_train_sampler(dataset)

    def _generate_and_score_completions(self, inputs):
        if not (inputs and all(key in inputs[0] for key in OFFLINE_COLUMNS)):
            return super()._generate_and_score_completions(inputs)
        device = self.accelerator.device
        pad = self.processing_class.pad_token_id if hasattr(self.processing_class, "pad_token_id") else \
            self.processing_class.tokenizer.pad_token_id
        prompt_ids = _pad([r["prompt_ids"] for r in inputs], pad, "left").to(device)
        prompt_mask = _pad([[1] * len(r["prompt_ids"]) for r in inputs], 0, "left").to(device)
        completion_ids = _pad([r["completion_ids"] for r in inputs], pad, "right").to(device)
        completion_mask = _pad([[1] * len(r["completion_ids"]) for r in inputs], 0, "right").to(device)
        scores = torch.tensor([float(r["score"]) for r in inputs], dtype=torch.float32, device=device)
        groups = torch.arange(len(inputs), device=device) // self.num_generations
        advantages = group_advantages(scores, groups, eps=self.advantage_eps, std="population")
        tokens = self.accelerator.gather(completion_mask.sum()).sum()
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask, "advantages": advantages, "num_items_in_batch": tokens}

    def _compute_loss(self, model, inputs):
        if not self.humanline_enabled:  # `humanline=False`: TRL's own
            return super()._compute_loss(model, inputs)
        mask = inputs["completion_mask"]
        inputs = dict(inputs)
        self._humanline_pending = (inputs, mask if "tool_mask" not in inputs else mask * inputs["tool_mask"])
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._humanline_pending = None

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """TRL's per-token log-probs; in ``_compute_loss``, the policy's are ``lp_ref + d_hl`` (see the module)."""
        out = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        pending, self._humanline_pending = self._humanline_pending, None
        if pending is None:
            return out
        inputs, mask = pending
        ref_kwargs = {key: value for key, value in kwargs.items() if key not in ("compute_entropy", "compute_aux_loss")}
        with torch.no_grad():
            reference = self._humanline_reference(model)
            ref_logps = super()._get_per_token_logps_and_entropies(reference, *args, **ref_kwargs)[0]
        policy_logps = out[0]
        log_ratios, metrics, _ = self._humanline_log_ratios(policy_logps, ref_logps, mask, lead=0)
        humanline_logps = ref_logps + log_ratios
        inputs["old_per_token_logps"] = ref_logps  # TRL's ratio: exp(d_hl), against the synced reference
        # TRL forms `x - (lp_ref + d_hl)` for its KL term and its off-policy mask: with `x` below it is lp_ref - lp_pol,
        # the unclamped log-ratio against the synced reference (with its gradient, for the KL term)
        unclamped = 2 * ref_logps - policy_logps + log_ratios
        if self.beta != 0.0:
            inputs["ref_per_token_logps"] = unclamped
        if self.args.off_policy_mask_threshold is not None:
            inputs["sampling_per_token_logps"] = unclamped.detach()
        self._humanline_count(metrics)
        return (humanline_logps, *out[1:])
