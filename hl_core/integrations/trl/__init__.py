"""Humanline on TRL's own trainers (tested with trl 1.16.0: ``pip install -e .[trl]``).

* :class:`HumanlineDPOTrainer`, :class:`HumanlineKTOTrainer`, :class:`HumanlineGRPOTrainer`: TRL's ``DPOTrainer``,
  ``KTOTrainer`` and ``GRPOTrainer`` with the per-token transform of ``hl_core.humanline`` (``ClipTransform`` by
  default) applied before the sequence sums (DPO, KTO) or before ``exp()`` of the ratio (GRPO), and the reference
  synced every ``k`` updates with the pre-update weights (``schedule=SyncSchedule(every=k)``).
* :class:`HumanlineSyncCallback`: the sync's moment on transformers' Trainer (``on_pre_optimizer_step``; under
  DeepSpeed, the engine's step), with our shard-local copy (``pair_parameters``; no gather under ZeRO-3).

See "TRL" in ``docs/howto/own-loop.md``. Another TRL version whose internals differ is refused
(:class:`UnsupportedTrlError`); so is ``use_liger_kernel=True`` with clipping (:class:`HumanlineTrlSettingError`).
"""

from .compat import TESTED_TRL, HumanlineTrlSettingError, UnsupportedTrlError, check_trl
from .dpo import HumanlineDPOTrainer
from .grpo import HumanlineGRPOTrainer
from .kto import HumanlineKTOTrainer
from .sync import HumanlineSyncCallback

__all__ = [
    "TESTED_TRL",
    "HumanlineDPOTrainer",
    "HumanlineGRPOTrainer",
    "HumanlineKTOTrainer",
    "HumanlineSyncCallback",
    "HumanlineTrlSettingError",
    "UnsupportedTrlError",
    "check_trl",
]
