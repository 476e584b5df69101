"""Humanline, written once: the public API that our trainer, your own loop (plain torch, DDP, FSDP2, DeepSpeed,
Megatron-core) and the TRL adapter all call.

The method ("Humanline: Online Alignment as Perceptual Loss", Liu, Muennighoff, Ethayarajh, 2025) is described in
the project's docs, ``docs/concepts/method.md``; the page "humanline in your own loop" (``docs/howto/own-loop.md``)
builds a loop from these names, and ``docs/reference/humanline-api.md`` says which are stable.

* **Inputs**: ``prefix_token_logps`` (per-token log-probs from logits, 0 at position 0), ``fused_sequence_token_logps``
  (the same from the hidden states, without the logits), ``mask_from_labels`` (the mask over them).
* **Transforms** of per-token log-ratios, applied before tokens are summed into a sequence reward (DPO, KTO) or
  exponentiated into a ratio (GRPO): ``ClipTransform``, ``SampleTransform``, ``NoTransform`` (base
  ``LogRatioTransform``). Their metrics are device tensors.
* **The sync**: ``SyncSchedule`` (``k``, offset, mix); ``pair_parameters`` (two DeepSpeed engines at ZeRO 0-3, two
  lists of Megatron-core model chunks at any TP/PP, two ``nn.Module`` objects with DDP or FSDP2) or
  ``pair_lora_adapters`` (a PEFT model's trainable adapter and its frozen reference twin) give ``ParameterPairs``;
  ``ReferenceSync`` runs it at the right moment (``attach(optimizer_or_engine)`` or
  ``before_optimizer_step(updates_done)``, never both: ``SyncUsageError``), reports a ``SyncRecord`` and saves its
  state (``state_dict``).
* **The arithmetic** under the classes (the clamp, the rejection draws, the elementwise mix) is in
  ``hl_core.humanline.functional``.
* **Checkpoint files** read weights-only: ``load_checkpoint_file`` (one file), ``check_checkpoint_files`` (a whole
  directory, on every rank before any loads), ``weights_only_checkpoints`` (a DeepSpeed engine's ``load_checkpoint``).
* **Refusals**, each one paragraph naming the argument and the fix: ``HumanlineUsageError`` (a bad argument; every
  entry point checks its own before any tensor is touched: ``hl_core/humanline/contract.py``),
  ``HumanlineStateError`` (a refused load, nothing changed), ``SyncUsageError`` (a sync that would not sync once per
  update: driven two ways, a second sync on one reference, parameters replaced since pairing) and
  ``NonFiniteLogRatioError`` (a non-finite log-prob where the mask counts: the update is refused).
"""

from ..errors import HumanlineStateError, HumanlineUsageError, NonFiniteLogRatioError, SyncUsageError
from . import functional
from .files import check_checkpoint_files, load_checkpoint_file, weights_only_checkpoints
from .hooks import ReferenceSync, SyncRecord
from .inputs import fused_sequence_token_logps, mask_from_labels, prefix_token_logps
from .schedule import SyncSchedule
from .sync import ParameterPairs, pair_lora_adapters, pair_parameters
from .transforms import ClipTransform, LogRatioTransform, NoTransform, SampleTransform

__all__ = [
    "ClipTransform",
    "HumanlineStateError",
    "HumanlineUsageError",
    "LogRatioTransform",
    "NoTransform",
    "NonFiniteLogRatioError",
    "ParameterPairs",
    "ReferenceSync",
    "SampleTransform",
    "SyncRecord",
    "SyncSchedule",
    "SyncUsageError",
    "check_checkpoint_files",
    "functional",
    "fused_sequence_token_logps",
    "load_checkpoint_file",
    "mask_from_labels",
    "pair_lora_adapters",
    "pair_parameters",
    "prefix_token_logps",
    "weights_only_checkpoints",
]
