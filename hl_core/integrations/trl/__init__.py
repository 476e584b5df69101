"""Humanline on TRL's own trainers (trl>=1.14,<1.17: ``pip install -e .[trl]``; docs/howto/trl.md).

* ``HumanlineDPOTrainer``, ``HumanlineKTOTrainer``, ``HumanlineGRPOTrainer``: TRL's ``DPOTrainer``, ``KTOTrainer`` and
  ``GRPOTrainer`` whose own losses run on the per-token log-ratios transformed by ``hl_core.humanline``: TRL is
  handed ``lp_ref + d_hl`` as the policy's log-probs (GRPO: and the synced reference's as the old policy's), and the
  reference is synced every ``k`` updates with the pre-update weights. The moved reference, the sync's and the
  transform's state go into TRL's checkpoints; a resume checks the whole checkpoint before anything is loaded.
* ``HumanlineDPOConfig``, ``HumanlineKTOConfig``, ``HumanlineGRPOConfig``: TRL's configs with the humanline fields
  (``humanline``, ``humanline_log_eps_P``, ``humanline_log_eps_R``, ``humanline_sync_freq``, ...); the trainers read
  them (``humanline=False`` is TRL's own trainer). With TRL's own config, the keywords ``transform=`` and
  ``schedule=`` set the same.
* ``HumanlineSyncCallback``: the sync's moment on transformers' Trainer (``on_pre_optimizer_step``; under
  DeepSpeed, the engine's step), with our shard-local copy (``pair_parameters``; no gather under ZeRO-3). It also
  syncs the reference of a stock TRL trainer, without a subclass.
* ``python -m hl_core.integrations.trl dpo|kto|grpo --config FILE.yaml``: TRL's training scripts with these trainers.

Another TRL release, or one lacking an internal the adapter touches (``internals.INTERNALS``), is refused
(``UnsupportedTrlError``); so are the settings, keywords and checkpoints it cannot honour
(``HumanlineTrlSettingError``).
"""

from .compat import TESTED_TRL, HumanlineTrlSettingError, UnsupportedTrlError, check_trl
from .config import HumanlineDPOConfig, HumanlineGRPOConfig, HumanlineKTOConfig
from .dpo import HumanlineDPOTrainer
from .grpo import HumanlineGRPOTrainer
from .kto import HumanlineKTOTrainer
from .sync import HumanlineSyncCallback

__all__ = [
    "TESTED_TRL",
    "HumanlineDPOConfig",
    "HumanlineDPOTrainer",
    "HumanlineGRPOConfig",
    "HumanlineGRPOTrainer",
    "HumanlineKTOConfig",
    "HumanlineKTOTrainer",
    "HumanlineSyncCallback",
    "HumanlineTrlSettingError",
    "UnsupportedTrlError",
    "check_trl",
]
