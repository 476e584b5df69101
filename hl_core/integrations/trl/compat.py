"""What the TRL adapter needs from TRL's internals, checked before a trainer is built, and the settings it refuses.

The adapter overrides private methods of TRL's trainers (``_compute_loss``, ``_prepare_dataset``) and reads the
per-token log-probabilities of TRL's fused LM head. Another TRL version may name or shape these differently; the
adapter then refuses (:class:`UnsupportedTrlError`) instead of training something else silently.
"""

from __future__ import annotations

import inspect
from typing import List

import transformers
import trl
from trl.trainer import utils as trl_utils

from hl_core.errors import UserError

TESTED_TRL = "1.16.0"
INSTALL = "pip install -e .[trl]"


class UnsupportedTrlError(UserError):
    """The installed TRL lacks an internal the adapter overrides or reads."""


class HumanlineTrlSettingError(UserError):
    """A TRL setting the humanline adapter cannot honour (the message names it and the fix)."""


# (trainer, method, the parameters the adapter relies on, what the adapter does there)
_METHODS = {
    "DPOTrainer": [("_compute_loss", ("model", "inputs", "return_outputs"), "clip before the sequence sums"),
                   ("_prepare_dataset", ("dataset", "processing_class", "args", "dataset_name"),
                    "take token ids as given")],
    "KTOTrainer": [("_compute_loss", ("model", "inputs", "return_outputs"), "clip before the sequence sums"),
                   ("_prepare_dataset", ("dataset", "processing_class", "args", "dataset_name"),
                    "take token ids as given")],
    "GRPOTrainer": [("_compute_loss", ("model", "inputs"), "clip before exp() of the ratio"),
                    ("_get_per_token_logps_and_entropies", ("model", "input_ids", "attention_mask", "logits_to_keep"),
                     "the per-token log-probs of the policy and the reference")],
}


def missing_internals(trainer: str) -> List[str]:
    """The internals of ``trl.<trainer>`` the adapter relies on that the installed TRL lacks (empty: all there)."""
    missing = []
    cls = getattr(trl, trainer, None)
    if cls is None:
        return [f"`trl.{trainer}`"]
    for name, params, purpose in _METHODS[trainer]:
        method = getattr(cls, name, None)
        have = list(inspect.signature(method).parameters)[1:] if callable(method) else None
        if have is None or tuple(have[:len(params)]) != params:
            missing.append(f"`{trainer}.{name}({', '.join(params)})` ({purpose})")
    if trainer in ("DPOTrainer", "KTOTrainer") and "outputs" not in inspect.signature(
            getattr(trl_utils, "add_fused_lm_head", lambda: None)).parameters:
        missing.append("`trl.trainer.utils.add_fused_lm_head(model, outputs=...)` (per-token log-probs)")
    if not hasattr(transformers.TrainerCallback, "on_pre_optimizer_step"):
        missing.append("`transformers.TrainerCallback.on_pre_optimizer_step` (the sync's moment)")
    return missing


def check_trl(trainer: str) -> None:
    """Refuse an installed TRL whose internals differ from those of the tested version.

    Raises:
        UnsupportedTrlError: one paragraph naming the installed version, what is missing and the fix.
    """
    missing = missing_internals(trainer)
    if missing:
        raise UnsupportedTrlError(
            f"humanline's TRL adapter was written and tested against trl {TESTED_TRL}, and the installed trl "
            f"{trl.__version__} lacks {', '.join(missing)}, so the adapter cannot put the per-token clip and the "
            f"reference sync where they belong and will not fall back to TRL's plain objective. Fix: install the "
            f"tested version (`{INSTALL}`, which pins trl=={TESTED_TRL}), or use our own trainer "
            f"(launchers/run.py) or your own loop (docs/howto/own-loop.md)."
        )


def check_settings(args, clipping: bool) -> None:
    """Refuse TRL settings the humanline objective cannot honour."""
    if clipping and getattr(args, "use_liger_kernel", False):
        raise HumanlineTrlSettingError(
            "`use_liger_kernel=True` cannot be combined with humanline clipping: TRL's Liger path computes the loss "
            "inside a fused kernel that reduces each sequence to one summed log-prob, so the per-token log-ratios "
            "that humanline clamps before the sum (or before exp() in GRPO) never exist outside the kernel. Fix: "
            "set `use_liger_kernel=False` (the adapter's chunked per-token log-probs are memory-light already), or "
            "drop clipping (`transform=NoTransform()`) if you only want the reference sync."
        )
    if getattr(args, "precompute_ref_log_probs", False):
        raise HumanlineTrlSettingError(
            "`precompute_ref_log_probs=True` cannot be combined with the humanline adapter: syncing moves the "
            "reference every k updates, so log-probs computed once before training go stale, and clipping needs "
            "the per-token reference log-probs, which TRL's precompute stores only as sequence sums. Fix: set "
            "`precompute_ref_log_probs=False` and pass a `ref_model`."
        )
    if getattr(args, "sync_ref_model", False):
        raise HumanlineTrlSettingError(
            "`sync_ref_model=True` adds TRL's own SyncRefModelCallback, which copies the reference at `on_step_end`, "
            "after the optimizer step (the post-update weights, gathered whole under ZeRO-3); the humanline adapter "
            "syncs the pre-update weights shard by shard itself. Fix: set `sync_ref_model=False` and give the sync "
            "period as `schedule=SyncSchedule(every=k)`."
        )
