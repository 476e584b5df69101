"""A run's start and end in its output directory, before the engine is built and after the loop:

* the directory's lock (``storage.run_lock``: one run per ``output_dir``), taken by rank 0 first of all;
* a ``final/`` replacement that a kill interrupted is put back (``storage.checkpoints.recover_final``);
* the checkpoint to resume and its run record (``run_record``): a refused change ends the run here, before any
  weights are loaded;
* another run's outputs in the directory: a run that starts afresh (``checkpoint.resume: never``, a checkpoint of
  another directory, or ``auto`` with nothing to resume beside an earlier run's ``final/``), or resumes an earlier
  checkpoint than the newest, would mix two runs (rotation deletes the new run's checkpoints as older than the
  other's, a later ``auto`` resumes the other run and overwrites ``final/``): refused, unless
  ``checkpoint.overwrite: true`` removes the other run's checkpoints and ``final/`` first;
* a run that is already complete says so and how to extend it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..errors import RecipeError
from ..storage import checkpoints as ckpt
from ..storage.run_lock import OutputDirLock
from .run_record import ResumeCheck, check_resume_record, run_record


@dataclass
class RunStart:
    """What ``begin_run`` found: the lock (rank 0), the checkpoint to resume (or None), this run's record, the
    lines to print, and whether the held-out history starts again."""

    lock: Optional[OutputDirLock]
    target: Optional[Path]
    record: dict
    notices: List[str] = field(default_factory=list)
    eval_changed: bool = False


def _resume_point(target: Optional[Path], checkpoints: Path) -> int:
    """The update count of ``target`` when it is one of this directory's checkpoints, else -1 (a fresh start, or
    another run's checkpoint)."""
    if target is None or target.parent.resolve() != checkpoints.resolve():
        return -1
    return int(target.name[len(ckpt.CHECKPOINT_PREFIX):])


def other_run(output_dir: Path, target: Optional[Path]) -> List[Path]:
    """Another run's outputs this run would mix with: complete checkpoints newer than the one it resumes, and,
    starting afresh, ``final/``."""
    checkpoints = output_dir / "checkpoints"
    point = _resume_point(target, checkpoints)
    found = [path for n, path in reversed(ckpt.step_dirs(checkpoints)) if n > point and ckpt.is_complete(path)]
    final = output_dir / ckpt.FINAL_DIR
    if point < 0 and final.is_dir():
        found.append(final)
    return found


def check_other_run(recipe, target: Optional[Path]) -> List[Path]:
    """Another run's outputs in ``output_dir`` that this run (resuming ``target``) would mix with: refused
    (``RecipeError``) unless ``checkpoint.overwrite``; else the list of what to delete."""
    found = other_run(Path(recipe.output_dir), target)
    if found and not recipe.checkpoint.overwrite:
        _refuse_other_run(recipe, found, target)
    return found


def _refuse_other_run(recipe, found: List[Path], target: Optional[Path]) -> None:
    output_dir = Path(recipe.output_dir)
    names = ", ".join(f"`{p.relative_to(output_dir)}`" for p in found)
    resume = recipe.checkpoint.resume
    if resume == "auto":
        why = ("holds the `final/` of a finished run but no complete checkpoint to continue it from (with "
               "`checkpoint.save_every: null` a run keeps none), so `checkpoint.resume: auto` would start afresh")
    elif target is None:
        why = "holds another run's outputs and `checkpoint.resume: never` starts afresh"
    elif _resume_point(target, output_dir / "checkpoints") < 0:
        why = f"holds another run's outputs and this run resumes `{target}`, a checkpoint of another directory"
    else:
        why = f"holds outputs newer than `{target}`, which this run resumes"
    raise RecipeError(
        f"`output_dir: {output_dir}` {why}: {names}. Two runs in one directory mix: rotation deletes the new run's "
        "checkpoints as older than the other's, and a later `auto` resumes the other run and overwrites `final/`. "
        "Fix: use another `output_dir`, or resume the newest checkpoint (`checkpoint.resume=auto`), or set "
        f"`checkpoint.overwrite=true` to delete {names} first."
    )


def begin_run(recipe, world_size: int, rank: int) -> RunStart:
    """Before the engine is built, on every rank (rank 0 alone takes the lock and changes the directory)."""
    output_dir = Path(recipe.output_dir)
    lock = OutputDirLock(output_dir).acquire() if rank == 0 else None
    try:
        notices = [lock.notice] if lock is not None and lock.notice else []
        if rank == 0:
            notices.append(ckpt.recover_final(output_dir))
        target, skipped = ckpt.resume_target(recipe.checkpoint.resume, output_dir)
        notices.append(skipped)
        found = check_other_run(recipe, target)
        if found and rank == 0:
            for path in found:
                shutil.rmtree(path)
            notices.append(f"`checkpoint.overwrite`: deleted the other run's {', '.join(p.name for p in found)} "
                           f"from {output_dir}.")
        record = run_record(recipe, world_size)
        check = check_resume_record(target, recipe, record) if target is not None else ResumeCheck()
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return RunStart(lock, target, record, [n for n in notices + check.notices if n], check.eval_changed)


def already_complete(output_dir: Path, updates_done: int, has_final: bool) -> str:
    """The line a rerun of a finished run prints instead of training."""
    final = ", `final/`" if has_final else ""
    return (f"`{output_dir}` already holds a finished run of {updates_done} updates (`checkpoints/"
            f"{ckpt.CHECKPOINT_PREFIX}{updates_done}`{final}): nothing to train. To train further, rerun with "
            f"`train.max_steps=<more than {updates_done}>` (it continues from there); to start afresh, use another "
            "`output_dir` or `checkpoint.resume=never checkpoint.overwrite=true`.")
