"""Humanline GRPO on TRL's ``GRPOTrainer``: the per-token log-ratio against the synced reference is transformed
(clipped) before ``exp()`` turns it into the ratio, then PPO-clipped (so clipped twice), as the method says.

:class:`HumanlineGRPOTrainer` overrides ``_compute_loss`` with the pack's GRPO loss (``hl_core.objectives.grpo``):
``rho = exp(d_hl)``, ``-min(rho A, clamp(rho, 1 - eps_low, 1 + eps_high) A) + beta k3`` (``k3`` on the unclamped
log-ratio), aggregated as TRL's ``loss_type`` says (``bnpo``: the micro-batch's tokens, the pack's ``token``;
``grpo``: mean of per-sequence means, the pack's ``sequence``; ``dapo``: tokens over all processes, the pack's
``dapo``). Log-probs come from TRL's fused LM head at ``GRPOConfig.temperature``. It always keeps a reference model
(TRL keeps none at ``beta=0``): ``ref_model=`` or a copy of the policy.

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
from trl.trainer.utils import add_fused_lm_head, create_model_from_path, disable_dropout_in_model, get_config_model_id

from hl_core.objectives.grpo import group_advantages, grpo_loss

from .compat import HumanlineTrlSettingError
from .mixin import HumanlineMixin

OFFLINE_COLUMNS = ("prompt_ids", "completion_ids", "score")
AGGREGATIONS = {"bnpo": "token", "grpo": "sequence", "dapo": "dapo"}


def _pad(rows, value, side):
    width = max(len(r) for r in rows)
    return torch.tensor([([value] * (width - len(r)) if side == "left" else []) + list(r)
                         + ([value] * (width - len(r)) if side == "right" else []) for r in rows])


def _scores_in_the_data(completions, **kwargs):
    raise AssertionError("offline groups carry their scores: nothing is generated or scored")


class HumanlineGRPOTrainer(HumanlineMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` with humanline clipping (``transform``) and syncing (``schedule``).

    Extra keyword arguments: ``ref_model`` (the reference; default: a copy of the policy) and ``advantage_eps``
    (offline groups' advantages, default 1e-4). Offline groups need no reward function (``reward_funcs=[]``).
    """

    _trl_trainer = "GRPOTrainer"

    def __init__(self, *args, ref_model=None, advantage_eps: float = 1e-4, **kwargs):
        settings = kwargs.get("args", args[2] if len(args) > 2 else None)
        if settings is not None and settings.loss_type not in AGGREGATIONS:
            raise HumanlineTrlSettingError(
                f"HumanlineGRPOTrainer computes humanline GRPO (clipped log-ratio against the synced reference, then "
                f"the PPO clip) and does not implement `loss_type={settings.loss_type!r}`. Fix: use one of "
                f"{sorted(AGGREGATIONS)} (token sum / micro-batch tokens, mean of sequence means, tokens over all "
                "processes)."
            )
        if settings is not None and settings.importance_sampling_level != "token":
            raise HumanlineTrlSettingError(
                "HumanlineGRPOTrainer clips each token's log-ratio before exp(), so it needs "
                "`importance_sampling_level='token'`; a sequence-level ratio has no per-token log-ratio to clip."
            )
        self.advantage_eps = advantage_eps
        self._humanline_ref = ref_model
        if not kwargs.get("reward_funcs", True) and self._offline(kwargs.get("train_dataset")):
            kwargs["reward_funcs"] = [_scores_in_the_data]  # offline groups: TRL wants a reward source all the same
        super().__init__(*args, **kwargs)

    def _ensure_reference(self) -> None:
        if self.ref_model is None:
            self.ref_model = self._build_reference(self._humanline_ref)
        self._humanline_ref = None

    def _build_reference(self, ref_model):
        """The reference TRL builds at ``beta != 0``, here at any beta: prepared as TRL prepares its own. Under
        ZeRO-3 the policy may be partitioned already (loaded under ``zero.Init``), so the reference is loaded as TRL
        loads its own, from the policy's checkpoint; otherwise it is a copy of the policy."""
        ref = ref_model
        if ref is None and self.is_deepspeed_enabled and self.accelerator.state.deepspeed_plugin.zero_stage == 3:
            ref = create_model_from_path(get_config_model_id(self.model.config), dtype=self.model.dtype,
                                         attn_implementation=self.model.config._attn_implementation)
        elif ref is None:
            ref = copy.deepcopy(self.model)
        ref.requires_grad_(False)
        if self.args.disable_dropout:
            disable_dropout_in_model(ref)
        add_fused_lm_head(ref, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
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
        mode = "train" if self.model.training else "eval"
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        keep = inputs["completion_ids"].shape[1]
        mask = inputs["completion_mask"]
        policy_logps = self._get_per_token_logps_and_entropies(model, input_ids, attention_mask, keep)[0]
        with torch.no_grad():
            ref_logps = self._get_per_token_logps_and_entropies(self.ref_model, input_ids, attention_mask, keep)[0]
        log_ratios, metrics, _ = self._humanline_log_ratios(policy_logps, ref_logps, mask, lead=0)
        aggregation = AGGREGATIONS[self.loss_type]
        tokens_per_rank, scale = None, 1.0
        if aggregation == "dapo":  # TRL's normaliser: the generation batch's tokens per process, per accumulation step
            tokens_per_rank = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                tokens_per_rank = tokens_per_rank * self.current_gradient_accumulation_steps / \
                    self.args.steps_per_generation
        elif mode == "train":
            scale = self.current_gradient_accumulation_steps
        advantages = inputs["advantages"]
        loss, grpo_metrics = grpo_loss(
            log_ratios, mask, advantages if advantages.dim() == 1 else advantages[:, 0],
            eps_low=self.epsilon_low, eps_high=self.epsilon_high,
            ref_logratios=(policy_logps - ref_logps) * mask, beta_kl=self.beta, aggregation=aggregation,
            tokens_per_rank=None if tokens_per_rank is None else float(tokens_per_rank))
        unclamped = self.accelerator.gather(metrics["unclamped_frac"].reshape(1))
        self._metrics[mode]["humanline/clipped_frac"].append(1.0 - unclamped.mean().item())
        for key in ("clip/frac", "ratio/mean", "kl/mean"):
            if key in grpo_metrics:
                self._metrics[mode][key].append(grpo_metrics[key])
        return loss / scale
