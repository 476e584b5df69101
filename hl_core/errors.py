"""User-facing errors.

Every mistake a user can make in a recipe or a data file is raised as a
``UserError``: the launcher prints its one-paragraph message (no traceback) and
exits with code 2. Code bugs stay ordinary exceptions.
"""

from __future__ import annotations

import difflib
import sys
from typing import Iterable, Optional

EXIT_USER_ERROR = 2
EXIT_DISK_FULL = 5  # the same as ``hl_core.loop.guard.EXIT_DISK_FULL``: the disk filled while the run wrote a file


class UserError(Exception):
    """A mistake in the user's recipe, command line or data: message names the place and the fix.

    ``rank_local``: raised by one rank about its own input (a checkpoint file of its own), so every rank that raises
    it prints it (the others print only rank 0's: they all raise the same)."""

    exit_code = EXIT_USER_ERROR
    rank_local = False

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class RecipeError(UserError):
    """A bad recipe key, value or combination of values."""


class CheckpointFileError(RecipeError):
    """A checkpoint file refused by a load (code that would run, damage): a rank's own file, so it is printed by the
    rank that read it."""

    rank_local = True


class DataError(UserError):
    """A bad data file or data row; the message names ``file:line`` (or row index)."""


class LaunchError(UserError):
    """A bad launch environment (``RANK``, ``WORLD_SIZE``, ...): every process prints it, since the processes
    cannot agree on which of them is rank 0."""


class HumanlineUsageError(UserError, ValueError, TypeError):
    """A bad argument to the public Python API (``hl_core.humanline``, ``hl_core.humanline.functional``,
    ``hl_core.mcore``), refused at the boundary before any tensor is touched: the message names the argument, what
    it accepts and the fix, in one paragraph. A ``ValueError`` and a ``TypeError`` (code that caught the API's
    earlier errors still does) and a ``UserError`` (a command line prints the paragraph and exits 2)."""


class HumanlineStateError(HumanlineUsageError):
    """A saved state or file refused by a load (``ReferenceSync.load_state_dict``, a transform's
    ``load_state_dict``, ``hl_core.humanline.load_checkpoint_file``, a weights-only DeepSpeed engine): missing or
    extra keys, wrong types, shapes or dtypes, non-finite values, a checksum that does not match, a damaged file, or
    objects that could run code. Nothing was changed and nothing from the file ran."""


class SyncUsageError(HumanlineUsageError, RuntimeError):
    """A reference sync used in a way that would sync other than once per update, or sync stale tensors:
    ``ReferenceSync`` driven two ways at once (attached and called by hand) or attached twice, a second
    ``ReferenceSync`` on a reference another one drives, or a sync whose paired parameters were replaced since
    pairing (e.g. ``load_state_dict(..., assign=True)``)."""


class NonFiniteLogRatioError(FloatingPointError):
    """A non-finite log-prob (NaN or inf) at a position the mask counts: the update is refused (exit code 3 on a
    command line, as the trainer's NaN guard stops a run). The message is one paragraph naming the argument, the
    first such position and the fix."""

    exit_code = 3

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class DiskFull(Exception):
    """The disk filled while ``path`` was written (exit code 5); the launcher prints one paragraph
    (``hl_core.storage.disk_full.disk_full_message``) naming it, the last complete checkpoint and the fix."""

    exit_code = EXIT_DISK_FULL

    def __init__(self, path, what: str):
        super().__init__(f"No space left on device while writing {what} `{path}`")
        self.path, self.what = str(path), what


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ' Did you mean `x`?' for the closest choice, or '' when nothing is close."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean `{match[0]}`?" if match else ""


def suggestion(word: str, choices: Iterable[str]) -> Optional[str]:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


def exit_on_user_error(main, *args) -> None:
    """``sys.exit(main(*args))``, turning a ``UserError`` into its one paragraph on stderr and exit code 2."""
    try:
        sys.exit(main(*args))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
