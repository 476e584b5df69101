"""What the TRL adapter needs from TRL's internals, checked before a trainer is built, and the settings it refuses.

The adapter wraps private methods of TRL's trainers (``_compute_loss``, ``_prepare_dataset``,
``GRPOTrainer._get_per_token_logps_and_entropies``) and the per-token log-probabilities of TRL's fused LM head. It
supports the TRL releases in ``SUPPORTED_TRL`` (what ``pip install -e .[trl]`` allows); another release, or one
lacking an internal, is refused (``UnsupportedTrlError``) instead of training something else silently.
"""

from __future__ import annotations

import inspect
import sys
from typing import List

import transformers
import trl
from packaging.version import Version
from trl.trainer import utils as trl_utils

from hl_core.errors import UserError

TESTED_TRL = "1.16.0"  # the newest release tested
SUPPORTED_TRL = (">=1.14", "<1.17")  # as setup.py's `trl` extra declares it
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
                    ("_get_per_token_logps_and_entropies", ("model",),
                     "the per-token log-probs of the policy and the reference")],
}


def fused_head_available() -> bool:
    """Whether TRL has the fused LM head the DPO and KTO adapters need (1.15 on; 1.14 takes log-probs from logits)."""
    return "outputs" in inspect.signature(getattr(trl_utils, "add_fused_lm_head", lambda: None)).parameters


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
    if trainer in ("DPOTrainer", "KTOTrainer") and not fused_head_available():
        module = sys.modules[cls.__module__]
        for name in ("selective_log_softmax", "selective_log_softmax_and_entropy"):
            function = getattr(module, name, None)
            params = list(inspect.signature(function).parameters) if callable(function) else []
            if params[:2] != ["logits", "index"] or "row_mask" not in params:
                missing.append(f"`{cls.__module__}.{name}(logits, index, ..., row_mask=)` (where the adapter hands "
                               f"{trainer}'s loss the transformed per-token log-probs, without TRL's fused LM head)")
    if not hasattr(transformers.TrainerCallback, "on_pre_optimizer_step"):
        missing.append("`transformers.TrainerCallback.on_pre_optimizer_step` (the sync's moment)")
    return missing


def supported_release(version: str) -> bool:
    """Whether ``version`` is in ``SUPPORTED_TRL`` (a pre-release of a supported release counts as it)."""
    release = Version(Version(version).base_version)
    return Version(SUPPORTED_TRL[0][2:]) <= release < Version(SUPPORTED_TRL[1][1:])


def check_trl(trainer: str) -> None:
    """Refuse an installed TRL outside the supported releases, or one lacking an internal the adapter wraps.

    Raises:
        UnsupportedTrlError: one paragraph naming the installed version, what is wrong and the fix.
    """
    missing = missing_internals(trainer)
    outside = not supported_release(trl.__version__)
    if missing or outside:
        why = [f"is outside the releases it supports (trl{','.join(SUPPORTED_TRL)})"] if outside else []
        why += [f"lacks {', '.join(missing)}"] if missing else []
        raise UnsupportedTrlError(
            f"humanline's TRL adapter wraps TRL's internals as they are in trl{','.join(SUPPORTED_TRL)} (tested "
            f"with 1.14.0 and {TESTED_TRL}), and the installed trl {trl.__version__} {' and '.join(why)}, so the "
            f"adapter cannot put the per-token clip and the reference sync where they belong and will not fall "
            f"back to TRL's plain objective. Fix: install a supported release (`{INSTALL}`, which asks for "
            f"trl{','.join(SUPPORTED_TRL)}), or use our own trainer (launchers/run.py) or your own loop "
            f"(docs/howto/own-loop.md)."
        )


def check_settings(args) -> None:
    """Refuse TRL settings the humanline objective cannot honour."""
    if getattr(args, "use_liger_kernel", False) and not fused_head_available():
        raise HumanlineTrlSettingError(
            f"`use_liger_kernel=True` cannot be combined with the humanline adapter on trl {trl.__version__}: there "
            "TRL computes the loss inside Liger's fused kernel, which reduces each sequence to one summed log-prob "
            "and takes GRPO's ratio against the old policy, so the per-token log-ratios against the synced reference "
            "that humanline transforms never exist outside the kernel. (From trl 1.15 on, `use_liger_kernel` only "
            "swaps layer kernels and is allowed.) Fix: set `use_liger_kernel=False`, or install trl>=1.15."
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
