"""Reading user files (recipes, data): regular files only, UTF-8, and where it is not, the place as ``file:line``."""

from __future__ import annotations

import os
import stat
from typing import Callable, Optional


def non_regular_file(path) -> Optional[str]:
    """What ``path`` is when it exists but is not a regular file (after symlinks): ``"a character device"``,
    ``"a FIFO"``, ...; None for a regular file, a directory or a missing path (their callers word those).
    Reading a device such as ``/dev/zero`` or a FIFO never ends, or blocks."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_regular_bytes(path, error: Callable[[str], Exception]) -> bytes:
    """The bytes of the regular file ``path``; ``error(kind)`` is raised for anything else (see
    `non_regular_file`), before a byte is read. Other ``OSError``\\ s propagate."""
    kind = non_regular_file(path)
    if kind is not None:
        raise error(kind)
    with open(path, "rb") as fh:
        return fh.read()


def decode_utf8(raw: bytes, path, error: Callable[[str, str], Exception]) -> str:
    """``raw`` as UTF-8 text; otherwise raises ``error(where, detail)``: ``where`` is ``path:line`` (1-based) of the
    first bad byte, ``detail`` names that byte and its column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise error(f"{path}:{line}", f"byte 0x{raw[exc.start]:02x} at column {column}") from None


def lone_surrogate(text: str) -> Optional[int]:
    """The index of the first UTF-16 surrogate code point in ``text`` (JSON's ``\\ud800`` escapes and YAML's
    produce them; they are no characters: UTF-8 cannot encode them and tokenizers refuse them), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None
