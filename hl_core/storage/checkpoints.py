"""Checkpoints on disk: visible only when complete, loaded without running anyone's code.

* A checkpoint ``<output_dir>/checkpoints/step_N/`` counts only once ``complete.json`` is in it: every rank
  writes its files (the engine's, our per-rank reference and source shards, the trainer state), then after a
  barrier rank 0 writes the marker (through a temporary file and a rename) and then ``latest``.
  ``checkpoint.resume: auto`` takes the newest complete checkpoint and says, in one line, which newer
  ones it ignored; DeepSpeed's ``latest`` file alone is never trusted.
* ``final/`` is written to ``.final.partial`` and swapped in when whole (``publish_final``): some complete
  ``final/`` exists at every instant.
* ``complete.json`` holds the update count and the run record (what the checkpoint was written with); a resume
  compares it with the recipe (``hl_core/loop/run_record.py``).
* Every checkpoint file is read with ``safe_load`` (``torch.load(weights_only=True)``); DeepSpeed's own files
  go through a checkpoint engine of ours whose allowlist holds exactly the classes DeepSpeed stores
  (``hl_core/engines/deepspeed_engine.py``): a file with anything else is refused (exit code 2) and
  nothing in it runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import torch

from ..errors import CheckpointFileError, RecipeError

COMPLETE_MARKER = "complete.json"
CHECKPOINT_PREFIX = "step_"
FINAL_DIR, FINAL_PARTIAL, FINAL_OLD = "final", ".final.partial", ".final.old"
_STEP = re.compile(r"step_(\d+)")


REFERENCE_LOGPS = "reference_logps_rank"


def reference_logps_file(rank: int) -> str:
    """A rank's look-ahead reference log-probs in a checkpoint (``hl_core.reference.sources.LookaheadReference``)."""
    return f"{REFERENCE_LOGPS}{rank:05d}.pt"


def rng_file(rank: int) -> str:
    """A rank's random generator states in a checkpoint (``Engine.rng_state``)."""
    return f"rng_rank{rank:05d}.pt"


def transform_file(rank: int) -> str:
    """A rank's humanline transform state in a checkpoint (``SampleTransform``'s generators; each data-parallel rank
    draws from its own)."""
    return f"transform_rank{rank:05d}.pt"


def wrote_lookahead(checkpoint: Path) -> bool:
    """The checkpoint was written by a look-ahead run (it keeps log-probs, not a reference copy)."""
    return any(Path(checkpoint).glob(f"{REFERENCE_LOGPS}*.pt"))


def step_dirs(directory: Path) -> List[Tuple[int, Path]]:
    """``(N, path)`` for every ``step_N`` directory in ``directory``, newest first."""
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name))]
    return sorted(found, reverse=True)


def is_complete(path: Path) -> bool:
    return (Path(path) / COMPLETE_MARKER).is_file()


def newest_complete(directory: Path) -> Tuple[Optional[Path], List[Path]]:
    """The newest complete checkpoint in ``directory`` (or None), and the newer incomplete ones passed over."""
    skipped = []
    for _, path in step_dirs(Path(directory)):
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def skipped_notice(skipped: List[Path], chosen: Optional[Path]) -> str:
    """One line about incomplete checkpoints that ``auto`` ignores (empty when there are none)."""
    if not skipped:
        return ""
    names = ", ".join(p.name for p in skipped)
    then = f"resuming from `{chosen.name}`" if chosen is not None else "starting afresh"
    return (f"Ignoring incomplete checkpoint(s) {names} in {skipped[0].parent} (no {COMPLETE_MARKER}: the save was "
            f"interrupted, or an older version wrote it, then add an empty {COMPLETE_MARKER} to use it); {then}.")


def mark_complete(path: Path, updates_done: int, run_record: Optional[dict] = None) -> None:
    """Rank 0, after every rank's files are written: the marker (the update count and the run record: what the
    checkpoint was written with, ``hl_core.loop.run_record``), then ``latest`` (both atomic renames)."""
    marker = {"updates_done": updates_done}
    if run_record is not None:
        marker["run"] = run_record
    _write_atomic(path / COMPLETE_MARKER, json.dumps(marker, indent=1))
    _write_atomic(path.parent / "latest", path.name)


def read_marker(path: Path) -> dict:
    """A complete checkpoint's ``complete.json``: ``{}`` when empty (an older version's checkpoint, or one marked by
    hand), else its ``updates_done`` (matching the ``step_N`` name) and ``run`` record. Anything else is refused
    (``RecipeError``): a damaged marker cannot say what the checkpoint holds."""
    marker_path = Path(path) / COMPLETE_MARKER
    text = marker_path.read_text(errors="replace").strip()
    if not text:
        return {}
    try:
        marker = json.loads(text)
    except ValueError:
        marker = None
    step = _STEP.fullmatch(Path(path).name)
    updates = marker.get("updates_done") if isinstance(marker, dict) else None
    if (not isinstance(marker, dict) or ("updates_done" in marker and (type(updates) is not int or (
            step is not None and updates != int(step.group(1))))) or not isinstance(marker.get("run", {}), dict)):
        raise RecipeError(
            f"The checkpoint marker `{marker_path}` is damaged: it should be the JSON object this pack writes "
            f"(`updates_done` equal to the directory's step, and the run record), but it holds "
            f"`{text[:60]}{'...' if len(text) > 60 else ''}`, so what the checkpoint holds is unknown. Fix: point "
            "`checkpoint.resume` at another `step_N`, remove this checkpoint so that `auto` takes the previous "
            f"complete one, or, if you know it is whole, empty `{COMPLETE_MARKER}` (resumed without the run checks)."
        )
    return marker


def read_megatron_layout(path: Path) -> dict:
    """A Megatron checkpoint's layout file (``{"tp", "pp", "world_size"}``, whole numbers); a damaged one is refused
    (``CheckpointFileError``): it cannot say how the checkpoint is sharded."""
    try:
        layout = json.loads(Path(path).read_text(errors="replace"))
        return {key: int(layout[key]) for key in ("tp", "pp", "world_size")}
    except (ValueError, TypeError, KeyError):
        raise CheckpointFileError(
            f"Checkpoint file `{path}` is damaged: it should be the JSON object this pack writes (`tp`, `pp`, "
            "`world_size`). Fix: point `checkpoint.resume` at an older `step_N`, or remove this one so that `auto` "
            "takes the previous complete checkpoint.") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def rotate(directory: Path, keep_last: int) -> None:
    """Rank 0, after a complete save: keep the newest ``keep_last`` complete checkpoints; remove older ones and
    the incomplete leftovers older than the newest complete one (a save interrupted in an earlier run)."""
    complete = 0
    for _, path in step_dirs(directory):
        if is_complete(path):
            complete += 1
            if complete > keep_last:
                shutil.rmtree(path, ignore_errors=True)
        elif complete:
            shutil.rmtree(path, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the platform or
    the file system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def publish_final(output_dir: Path) -> None:
    """Rank 0: ``.final.partial`` (whole) becomes ``final``. An older ``final`` is swapped out in one atomic step
    and then deleted, so a complete ``final/`` exists at every instant; where the file system cannot swap, the
    old one is renamed to ``.final.old`` first, and a kill between the two renames leaves it for
    `recover_final` to put back at the next start."""
    partial, final, old = output_dir / FINAL_PARTIAL, output_dir / FINAL_DIR, output_dir / FINAL_OLD
    if old.exists():
        shutil.rmtree(old)  # a finished replacement's leftover
    if final.exists() and _exchange(partial, final):
        os.replace(partial, old)  # the old model, now at `.final.partial`, out of the way of the next save
    else:
        if final.exists():
            os.replace(final, old)
        os.replace(partial, final)
    if old.exists():
        shutil.rmtree(old)


def recover_final(output_dir: Path) -> str:
    """Rank 0 at the start of a run: undo a ``final/`` replacement that a kill interrupted (``.final.old`` is
    the previous complete model); a one-line notice, or ''."""
    final, old = Path(output_dir) / FINAL_DIR, Path(output_dir) / FINAL_OLD
    if not old.exists():
        return ""
    if final.exists():
        shutil.rmtree(old)
        return ""
    os.replace(old, final)
    return (f"Restored `{final}` from `{old.name}`: a replacement of `final/` was interrupted before the new one "
            "was in place.")


# -------------------------------------------------------------------------------------------- loading
CODE, DAMAGED = "code", "damaged"  # why a file is refused: it holds more than data, or it does not read


def safe_load(path, map_location="cpu", allowed=(), refusal: Optional[Callable[[str, str, str], Exception]] = None,
              mmap: bool = False):
    """``torch.load(weights_only=True)`` with ``allowed`` classes. A file holding anything else is refused with one
    paragraph and nothing in it is run; so is a damaged or truncated file.

    Args:
        path: the file.
        map_location: as ``torch.load``'s.
        allowed: classes beyond tensors, numbers, strings and containers that the file may hold.
        refusal: ``refusal(path, why, detail) -> exception`` (``why``: ``CODE`` or ``DAMAGED``), the error raised;
            default: the launcher's ``RecipeError`` (exit code 2), whose fix names ``checkpoint.resume``.
        mmap: map the tensors' storage instead of reading it (a zip-format file; an older one is read whole).
    """
    refusal = refusal or recipe_refusal
    try:
        with torch.serialization.safe_globals(list(allowed)):
            if mmap and zipfile.is_zipfile(path):
                return torch.load(path, map_location=map_location, weights_only=True, mmap=True)
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights only load failed" not in str(exc).lower():
            raise refusal(str(path), DAMAGED, _first_line(exc)) from None
        unsafe = [line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line][:1]
        raise refusal(str(path), CODE, " ".join(unsafe)) from None
    except (EOFError, OSError, RuntimeError, ValueError, TypeError, KeyError, IndexError) as exc:
        # torch.load only reads this file here: a truncated archive, a storage shorter than its tensors claim
        # ("record size ... does not match"), a tensor beyond its storage ("out of bounds"), a malformed pickle
        raise refusal(str(path), DAMAGED, _first_line(exc)) from None


def check_files(directory, allowed=(), refusal: Optional[Callable[[str, str, str], Exception]] = None) -> None:
    """Every ``.pt`` file under ``directory`` read as ``safe_load`` would (its tensors mapped, not read), in sorted
    order, before anything is loaded from it: every rank meets the same file first and refuses it alike, so no rank
    loads while another has left (a collective would wait for it). Arguments as ``safe_load``'s."""
    for path in sorted(Path(directory).rglob("*.pt")):
        if path.is_file():
            safe_load(path, allowed=allowed, refusal=refusal, mmap=True)


def _first_line(exc: Exception) -> str:
    why = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else "empty or cut short"
    return f"{type(exc).__name__}: {why}"


def refused_code(path: str, detail: str) -> str:
    """The sentence every refusal of a file with more than data in it starts with."""
    return (f"Refused to load checkpoint file `{path}`: it holds objects outside what this pack's checkpoints contain "
            "(tensors, numbers, strings, containers and DeepSpeed's own state classes), so loading it could run code. "
            f"Nothing from it was run. {detail}")


def refusal(error: Callable[[str], Exception], code_fix: str, damaged_fix: str) -> Callable[[str, str, str], Exception]:
    """A ``safe_load`` refusal: ``error(paragraph)`` for a file with more than data in it (``code_fix``) or a damaged
    one (``damaged_fix``)."""
    def refuse(path: str, why: str, detail: str) -> Exception:
        if why == CODE:
            return error(f"{refused_code(path, detail)} Fix: {code_fix}")
        return error(f"Checkpoint file `{path}` cannot be read ({detail}): {damaged_fix}")

    return refuse


# the launcher's (``safe_load``'s default)
recipe_refusal = refusal(
    CheckpointFileError,
    "resume only from checkpoints this pack wrote, point `checkpoint.resume` at another checkpoint, or use "
    "`checkpoint.resume=never`.",
    "it is damaged or truncated although its checkpoint was marked complete. Fix: point `checkpoint.resume` at an "
    "older `step_N`, or remove this one so that `auto` takes the previous complete checkpoint.")


def resume_target(resume: str, output_dir) -> Tuple[Optional[Path], str]:
    """``checkpoint.resume`` -> the complete checkpoint to load (or None for a fresh start) and a one-line notice
    about newer incomplete ones passed over (or ''). ``check_resume`` (``hl_core/config/resume.py``) has already
    refused an explicit path that is not a complete checkpoint."""
    if resume == "never":
        return None, ""
    path = Path(output_dir) / "checkpoints" if resume == "auto" else Path(resume)
    if resume != "auto" and is_complete(path):
        return path, ""
    chosen, skipped = newest_complete(path)
    return chosen, skipped_notice(skipped, chosen)
