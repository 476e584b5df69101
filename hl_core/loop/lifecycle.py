"""A run's start and end in its output directory, before the engine is built and after the loop:

* the directory's lock (``storage.run_lock``: one run per ``output_dir``), taken by rank 0 first of all; an
  ``output_dir`` that is a symbolic link is said in one line naming where it points (a link to nothing: refused);
* a ``final/`` replacement that a kill interrupted is put back (``storage.checkpoints.recover_final``);
* the checkpoint to resume, its run record against this run's (``run_record``, which the trainer writes from the
  recipe): a refused change ends the run here, before any weights are loaded;
* another run's outputs in the directory: a run that starts afresh (``checkpoint.resume: never``, a checkpoint of
  another directory, or ``auto`` with nothing to resume beside an earlier run's ``final/``), or resumes an earlier
  checkpoint than the newest, would mix two runs (rotation deletes the new run's checkpoints as older than the
  other's, a later ``auto`` resumes the other run and overwrites ``final/``): refused, unless
  ``checkpoint.overwrite: true`` removes the other run's checkpoints and ``final/`` first;
* a ``STOP`` file older than this run (written before its process started, or beside the stale lock of a run
  that is gone): named in one line and honoured (the trainer checkpoints at its first update boundary and exits 0),
  since a stop request is never unsafe to follow and a launcher may write one just before a rank starts;
* a run that is already complete says so and how to extend it.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..errors import RecipeError
from ..storage import checkpoints as ckpt
from ..storage.run_lock import OutputDirLock
from .run_record import ResumeCheck, check_resume_record

# the stop request a launcher writes (e.g. the SLURM time-limit trap): the trainer checkpoints at the next update
# boundary and exits cleanly (``hl_core/trainer.py`` reads it)
STOP_FILE = "STOP"
_RUN_STARTED_AT: List[float] = []  # `note_run_start`: when the launcher's main() began (runs in a longer process)


def note_run_start(when: float) -> None:
    """The launcher's ``main()`` began at ``when`` (``time.time()``): a run inside a longer-lived process (a
    study's worker, a test) starts there, not at the process's start."""
    _RUN_STARTED_AT[:] = [when]


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


def check_other_run(output_dir: Path, checkpoint, target: Optional[Path]) -> List[Path]:
    """Another run's outputs in ``output_dir`` that this run (resuming ``target``) would mix with: refused
    (``RecipeError``) unless ``checkpoint.overwrite`` (``checkpoint``: the recipe's section); else the list of
    what to delete."""
    found = other_run(output_dir, target)
    if found and not checkpoint.overwrite:
        _refuse_other_run(output_dir, checkpoint.resume, found, target)
    return found


def _refuse_other_run(output_dir: Path, resume: str, found: List[Path], target: Optional[Path]) -> None:
    names = ", ".join(f"`{p.relative_to(output_dir)}`" for p in found)
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


def process_started_at(pid: Optional[int] = None) -> Optional[float]:
    """When the process ``pid`` (default: this one) started, in seconds since the epoch (Linux ``/proc``), else
    None."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat.rpartition(")")[2].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def stale_stop_notice(stop_mtime: Optional[float], started_at: Optional[float], lock_taken_over: bool,
                      path: Path) -> str:
    """The line for a ``STOP`` file (``stop_mtime``: its modification time, None when there is none) written before
    this run started (``started_at``) or left beside the stale lock this run took over; '' otherwise."""
    if stop_mtime is None:
        return ""
    # the process start is known to a clock tick (10 ms): a STOP written in the same tick is this run's
    older = started_at is not None and stop_mtime < started_at - 0.01
    if not (older or lock_taken_over):
        return ""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stop_mtime))
    why = (f"written at {when}, before this run started" if older
           else f"written at {when}, beside the lock of a run that is gone")
    return (f"`{path}` is stale ({why}): it is honoured, so this run checkpoints at its first update boundary and "
            f"stops (exit 0). If an earlier, killed run left it, delete `{path}` and rerun.")


def symlink_notice(output_dir: Path) -> str:
    """The line a run prints when ``output_dir`` is a symbolic link (naming where it points); '' when it is not.
    A link to nothing is refused (``RecipeError``)."""
    if not output_dir.is_symlink():
        return ""
    target, resolved = os.readlink(output_dir), output_dir.resolve()
    if not resolved.is_dir():
        raise RecipeError(
            f"`output_dir: {output_dir}` is a symbolic link to `{target}`, which is not a directory (or does not "
            f"exist). Fix: create `{resolved}`, or point `output_dir` at a directory.")
    shown = f"`{target}`" if str(resolved) == target else f"`{target}` (`{resolved}`)"
    return f"`output_dir: {output_dir}` is a symbolic link to {shown}: the run writes there."


def begin_run(output_dir: Path, checkpoint, record: dict, main: bool) -> RunStart:
    """Before the engine is built, on every rank (``main``: rank 0, which alone takes the lock and changes the
    directory).
    ``checkpoint``: the recipe's section (what to resume, whether another run's outputs may go); ``record``: this
    run's record (``run_record``), which a resumed checkpoint's must allow."""
    link = symlink_notice(output_dir) if main else ""
    lock = OutputDirLock(output_dir).acquire() if main else None
    try:
        notices = [link, lock.notice] if lock is not None and lock.notice else [link]
        if main:
            notices.append(ckpt.recover_final(output_dir))
            stop = output_dir / STOP_FILE
            mtime = stop.stat().st_mtime if stop.is_file() else None
            started = _RUN_STARTED_AT[0] if _RUN_STARTED_AT else process_started_at()
            notices.append(stale_stop_notice(mtime, started, bool(lock.notice), stop))
        target, skipped = ckpt.resume_target(checkpoint.resume, output_dir)
        notices.append(skipped)
        found = check_other_run(output_dir, checkpoint, target)
        if found and main:
            for path in found:
                shutil.rmtree(path)
            notices.append(f"`checkpoint.overwrite`: deleted the other run's {', '.join(p.name for p in found)} "
                           f"from {output_dir}.")
        check = check_resume_record(target, checkpoint.resume, record) if target is not None else ResumeCheck()
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
