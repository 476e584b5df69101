"""Humanline, written once: the public API that our trainer, your DeepSpeed loop, your Megatron-core loop and the TRL
adapter all call.

The method ("Humanline: Online Alignment as Perceptual Loss", Liu, Muennighoff, Ethayarajh, 2025) is described in
the project's docs, ``docs/concepts/method.md``; the page "humanline in your own loop" (``docs/howto/own-loop.md``)
shows these names at work, and ``docs/reference/humanline-api.md`` says which are stable.

* **Transforms** of per-token log-ratios, applied before tokens are summed into a sequence reward (DPO, KTO) or
  exponentiated into a ratio (GRPO): :class:`ClipTransform` (``clamp(lp_pol - lp_ref, log_eps_P, log_eps_R)``),
  :class:`SampleTransform` (two-sided token rejection), :class:`NoTransform` (the plain log-ratio); the functions
  :func:`clip_log_ratio`, :func:`rejection_mask`, :func:`unclamped_fraction`. Their metrics are device tensors.
* **The schedule**: :class:`SyncSchedule` (``k``, offset, mix), :func:`should_sync`, :func:`mix_into`.
* **The shard-local sync**: :func:`pair_parameters` (two DeepSpeed engines at ZeRO 0-3, two lists of Megatron-core
  model chunks at any TP/PP, two ``nn.Module`` objects with DDP or FSDP2), :func:`pair_lora_adapters` (a PEFT model's
  trainable adapter and its frozen reference twin), :class:`ParameterPairs`.
* **The moment**: :class:`ReferenceSync` (``before_optimizer_step(updates_done)``, or ``attach(optimizer)``), and
  :class:`SyncRecord`.
"""

from .attach import Attachment, SyncUsageError
from .hooks import ReferenceSync, SyncRecord
from .sampling import log_beta_sample, rejection_mask
from .schedule import SyncSchedule, mix_into, should_sync
from .sync import ParameterPairs, pair_lora_adapters, pair_parameters
from .transforms import (
    DEFAULT_LOG_EPS_P,
    DEFAULT_LOG_EPS_R,
    ClipTransform,
    LogRatioTransform,
    NoTransform,
    SampleTransform,
    clip_log_ratio,
    unclamped_fraction,
)

__all__ = [
    "DEFAULT_LOG_EPS_P",
    "DEFAULT_LOG_EPS_R",
    "ClipTransform",
    "LogRatioTransform",
    "NoTransform",
    "ParameterPairs",
    "ReferenceSync",
    "SampleTransform",
    "SyncRecord",
    "SyncSchedule",
    "SyncUsageError",
    "Attachment",
    "clip_log_ratio",
    "log_beta_sample",
    "mix_into",
    "pair_lora_adapters",
    "pair_parameters",
    "rejection_mask",
    "should_sync",
    "unclamped_fraction",
]
