"""Which TRL releases the adapter supports, checked before a trainer is built, and the settings it refuses.

The adapter wraps internals of TRL's trainers, declared once in ``internals.INTERNALS``. It supports the TRL
releases in ``SUPPORTED_TRL`` (what ``pip install -e .[trl]`` allows); another release, a version that cannot be
read, or one lacking an internal, is refused (``UnsupportedTrlError``) instead of training something else silently.
"""

from __future__ import annotations

from typing import Optional

import trl
from packaging.version import InvalidVersion, Version

import hl_core.integrations.trl.internals as internals
from hl_core.errors import HumanlineUsageError, UserError

TESTED_TRL = "1.16.0"  # the newest release tested
SUPPORTED_TRL = (">=1.14", "<1.17")  # as setup.py's `trl` extra declares it
INSTALL = "pip install -e .[trl]"


class UnsupportedTrlError(UserError):
    """The installed TRL is outside the supported releases, or lacks an internal the adapter overrides or reads."""


class HumanlineTrlSettingError(HumanlineUsageError):
    """A TRL setting, keyword or checkpoint the humanline adapter cannot honour (the message names it and the fix):
    the humanline API's ``HumanlineUsageError`` (a ``ValueError``, a ``TypeError`` and a ``UserError``) at the TRL
    adapter's door."""


def fused_head_available() -> bool:
    """Whether the installed TRL gives DPO and KTO their log-probs from the fused LM head (1.15 on; 1.14 from the
    logits): declared by the release (``internals.FUSED_FROM``), not probed."""
    return internals.uses_fused_head(trl.__version__)


def readable_release(version: str) -> Optional[Version]:
    """``version`` as a release (a pre-release counts as its release), or None where it is no version at all (a
    source checkout without metadata reports ``unknown``)."""
    try:
        return Version(Version(str(version)).base_version)
    except InvalidVersion:
        return None


def supported_release(version: str) -> bool:
    """Whether ``version`` is in ``SUPPORTED_TRL`` (a pre-release of a supported release counts as it)."""
    release = readable_release(version)
    return release is not None and Version(SUPPORTED_TRL[0][2:]) <= release < Version(SUPPORTED_TRL[1][1:])


def _refusal(why: str) -> UnsupportedTrlError:
    return UnsupportedTrlError(
        f"humanline's TRL adapter wraps TRL's internals as they are in trl{','.join(SUPPORTED_TRL)} (tested with "
        f"1.14.0 and {TESTED_TRL}), and the installed trl {why}, so the adapter cannot put the per-token clip and "
        f"the reference sync where they belong and will not fall back to TRL's plain objective. Fix: install a "
        f"supported release (`{INSTALL}`, which asks for trl{','.join(SUPPORTED_TRL)}), or use our own trainer "
        f"(launchers/run.py) or your own loop (docs/howto/own-loop.md)."
    )


def check_trl(trainer: str, instance=None) -> None:
    """Refuse an installed TRL outside the supported releases, or one lacking an internal ``trainer``'s humanline
    subclass relies on (``internals.INTERNALS``; with ``instance``, the built trainer's attributes).

    Raises:
        UnsupportedTrlError: one paragraph naming the installed version, what is wrong and the fix.
    """
    version = str(trl.__version__)
    if readable_release(version) is None:
        raise _refusal(f"reports its version as `{version}`, which is no release (a source checkout without "
                       "package metadata?), so which of TRL's internals it holds cannot be told")
    missing = internals.missing(trainer, version, instance)
    outside = not supported_release(version)
    if missing or outside:
        why = [f"is outside the releases it supports (trl{','.join(SUPPORTED_TRL)})"] if outside else []
        why += [f"lacks {', '.join(missing)}"] if missing else []
        raise _refusal(f"{version} {' and '.join(why)}")


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
