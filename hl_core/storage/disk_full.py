"""A disk that filled while the run wrote (``ENOSPC``): one paragraph and exit code 5, not a traceback.

The error reaches the launcher in several shapes: Python's ``OSError: [Errno 28]`` (its ``filename`` names the
file), torch's ``RuntimeError: [enforce fail at inline_container.cc:...] ... file write failed`` (the archive's
inner name only), or ``hl_core.errors.DiskFull`` raised where the file is known (the reference cache). The
paragraph names the file being written (known, or the newest file in ``output_dir``: the one the write stopped in),
the last complete checkpoint (nothing complete is lost: an incomplete checkpoint is ignored on resume and
``final/`` is swapped in only whole), the free space now, and the fix: free space and rerun.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from ..errors import DiskFull
from .checkpoints import newest_complete

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NO_SPACE_WORDS = ("No space left on device", "Disk quota exceeded", "os error 28")  # any library's wording
# torch's archive writer does not say why a write failed: ENOSPC surfaces as `basic_ios::clear: iostream error`,
# then `[enforce fail at inline_container.cc:672] . unexpected pos ...` (torch 2.13) or `... file write failed`
TORCH_WRITER_WORDS = ("inline_container.cc", "iostream error", "file write failed")
LOW_SPACE_BYTES = 64 * 2**20  # a torch write error with less than this free where the run writes: the disk is full


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_disk_full(exc: BaseException, directory=None) -> bool:
    """``exc`` (or an exception it was raised from) says the disk or a quota is full; a write error of torch's
    archive writer (which does not say why) counts when ``directory``'s file system has (almost) no space left."""
    for link in _chain(exc):
        if isinstance(link, DiskFull) or (isinstance(link, OSError) and link.errno in NO_SPACE):
            return True
        if any(words in str(link) for words in NO_SPACE_WORDS):
            return True  # e.g. safetensors' SafetensorError, transformers' wrapped OSError
        if isinstance(link, RuntimeError) and any(words in str(link) for words in TORCH_WRITER_WORDS):
            free = free_bytes(Path(directory)) if directory is not None else None
            if free is not None and free < LOW_SPACE_BYTES:
                return True
    return False


def written_path(exc: BaseException) -> Optional[str]:
    """The file the failed write named, where the exception knows it."""
    for link in _chain(exc):
        if isinstance(link, DiskFull):
            return link.path
        if isinstance(link, OSError) and link.filename:
            return str(link.filename)
    return None


def newest_file(directory: Path) -> Optional[Path]:
    """The most recently modified file under ``directory`` (the one a write stopped in), or None."""
    newest, when = None, -1.0
    for root, _, files in os.walk(directory):
        for name in files:
            path = Path(root) / name
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if mtime > when:
                newest, when = path, mtime
    return newest


def free_bytes(path: Path) -> Optional[int]:
    for candidate in [path, *path.parents]:
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return None


def disk_full_message(output_dir, exc: BaseException) -> str:
    """The paragraph for a full disk during the run in ``output_dir`` (``exc``: what the write raised)."""
    output_dir = Path(output_dir)
    path = written_path(exc) or newest_file(output_dir) or output_dir
    what = f"{exc.what} " if isinstance(exc, DiskFull) else ""
    last, _ = newest_complete(output_dir / "checkpoints")
    kept = (f"the last complete checkpoint is `{last}`, and a rerun resumes from it" if last is not None else
            "no checkpoint was complete yet, so a rerun starts afresh")
    free = free_bytes(output_dir)
    room = f" ({free / 2**20:,.0f} MiB free there now)" if free is not None else ""
    return (f"No space left on device while writing {what}`{path}`{room}. Nothing complete was lost: {kept} "
            "(an incomplete checkpoint is ignored on resume, `final/` is replaced only whole, the reference cache "
            "keeps its complete parts). Fix: free space on the file system of "
            f"`{output_dir}` (or set `checkpoint.keep_last` lower) and rerun the same command.")
