"""Your own loop's checkpoint files, read without running anyone's code: ``load_checkpoint_file`` for a file you
saved with ``torch.save`` (a sync's ``state_dict()``, a transform's, your model's and optimizer's),
``check_checkpoint_files`` for a whole checkpoint directory before any rank loads from it, and
``weights_only_checkpoints`` for a DeepSpeed engine's own ``load_checkpoint``, whose default checkpoint engine
unpickles (``weights_only=False``): a crafted file would run its code there.

Both read with ``torch.load(weights_only=True)`` (DeepSpeed's files with an allowlist of exactly the classes
DeepSpeed stores: ``hl_core/storage/deepspeed_checkpoints.py``, the one our trainer installs). A file holding
anything else, or a damaged one, is refused with one paragraph (``HumanlineStateError``) and nothing in it runs.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import HumanlineStateError
from ..storage.checkpoints import check_files, refusal, safe_load
from ..storage.deepspeed_checkpoints import deepspeed_safe_globals, safe_checkpoint_engine
from .contract import refuse

_refusal = refusal(
    HumanlineStateError,
    "load only checkpoints your own run wrote, and never pass weights_only=False to torch.load (or DeepSpeed's "
    "default checkpoint engine) for a file you did not write.",
    "it is damaged or truncated. Fix: resume from an intact copy of the checkpoint (or an older one), or start afresh.")


def load_checkpoint_file(path, map_location="cpu"):
    """``torch.load(path, map_location, weights_only=True)``, refused in one paragraph instead of a raw
    ``UnpicklingError`` (whose text suggests ``weights_only=False``).

    Args:
        path: a file written by ``torch.save`` (a ``str`` or ``os.PathLike``).
        map_location: as ``torch.load``'s (default: the CPU).

    Returns:
        What the file holds: tensors, numbers, strings and containers of them.

    Raises:
        HumanlineStateError: the file is missing, damaged or truncated, or holds anything else (code would run when
            unpickled: nothing of it ran).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise refuse("load_checkpoint_file", "path", "a file path (str or os.PathLike)", path,
                              "pass the path torch.save wrote")
    return safe_load(path, map_location=map_location, refusal=_refusal)


def check_checkpoint_files(directory) -> None:
    """Read every ``.pt`` file under ``directory`` weights-only (tensors mapped, not read) and refuse the first bad
    one, before anything is loaded: called by every rank on the whole checkpoint, every rank refuses the same file
    alike, so no rank is left waiting in a collective for one that stopped on its own file.

    Args:
        directory: the checkpoint directory (a ``str`` or ``os.PathLike``).

    Raises:
        HumanlineStateError: a file is damaged, truncated, or holds anything but tensors, numbers, strings,
            containers and DeepSpeed's own state classes (nothing of it ran).
        HumanlineUsageError: ``directory`` is not a directory.
    """
    if not isinstance(directory, (str, os.PathLike)) or not Path(directory).is_dir():
        raise refuse("check_checkpoint_files", "directory", "a checkpoint directory", directory,
                              "pass the directory your loop saved its checkpoint into")
    check_files(directory, allowed=_deepspeed_classes(), refusal=_refusal)


def _deepspeed_classes() -> list:
    """DeepSpeed's own state classes, where DeepSpeed is imported (its checkpoints hold them); else none."""
    return deepspeed_safe_globals() if "deepspeed" in sys.modules else []


def weights_only_checkpoints(model_engine):
    """Make a DeepSpeed engine's ``load_checkpoint`` read its files weights-only: one call, after
    ``deepspeed.initialize`` and before ``engine.load_checkpoint``.

    DeepSpeed's default checkpoint engine unpickles every file of a checkpoint (``weights_only=False``), so a
    crafted ``mp_rank_00_model_states.pt`` or ``*_optim_states.pt`` runs its code on load. This swaps in the
    checkpoint engine our trainer uses: ``torch.load(weights_only=True)`` with exactly the classes DeepSpeed stores
    (its loss scaler, ZeRO stage enum and fragment addresses); a file holding anything else is refused with a
    ``HumanlineStateError`` and nothing in it runs. ``load_checkpoint`` first checks every file of the tag's
    directory (``check_checkpoint_files``), so every rank refuses a bad file alike before any loads. Saving is
    unchanged.

    Args:
        model_engine: a ``deepspeed.DeepSpeedEngine`` (what ``deepspeed.initialize`` returned first).

    Returns:
        ``model_engine``, for chaining.

    Raises:
        HumanlineUsageError: ``model_engine`` is not a DeepSpeed engine.
    """
    deepspeed = sys.modules.get("deepspeed")
    if deepspeed is None or not isinstance(model_engine, deepspeed.DeepSpeedEngine):
        raise refuse("weights_only_checkpoints", "model_engine", "a DeepSpeed engine (deepspeed.initialize's"
                              " first result)", model_engine, "pass the engine whose load_checkpoint you call")
    model_engine.checkpoint_engine = safe_checkpoint_engine(model_engine._config, refusal=_refusal)
    load = model_engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        named = tag if tag is not None else _latest_tag(load_dir)
        if named is not None and (Path(load_dir) / str(named)).is_dir():
            check_checkpoint_files(Path(load_dir) / str(named))
        return load(load_dir, tag, *args, **kwargs)

    model_engine.load_checkpoint = load_checkpoint
    return model_engine


def _latest_tag(load_dir):
    """The tag DeepSpeed's ``load_checkpoint`` reads from ``load_dir/latest`` when none is given (None without one)."""
    latest = Path(load_dir) / "latest"
    return latest.read_text(errors="replace").strip() if latest.is_file() else None
