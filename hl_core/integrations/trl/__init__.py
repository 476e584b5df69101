"""Humanline on TRL's own trainers (trl>=1.14,<1.17: ``pip install -e .[trl]``; docs/howto/trl.md).

* ``HumanlineDPOTrainer``, ``HumanlineKTOTrainer``, ``HumanlineGRPOTrainer``: TRL's ``DPOTrainer``, ``KTOTrainer`` and
  ``GRPOTrainer`` whose own losses run on the per-token log-ratios transformed by ``hl_core.humanline``
  (``ClipTransform`` by default): TRL is handed ``lp_ref + d_hl`` as the policy's log-probs (GRPO: and the synced
  reference's as the old policy's), and the reference is synced every ``k`` updates with the pre-update weights
  (``schedule=SyncSchedule(every=k)``). The moved reference and the sync's state go into TRL's checkpoints.
* ``HumanlineSyncCallback``: the sync's moment on transformers' Trainer (``on_pre_optimizer_step``; under
  DeepSpeed, the engine's step), with our shard-local copy (``pair_parameters``; no gather under ZeRO-3). It also
  syncs the reference of a stock TRL trainer, without a subclass.

Another TRL release is refused (``UnsupportedTrlError``); so are the settings that conflict with a moving reference
or with per-token log-ratios (``HumanlineTrlSettingError``).
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
