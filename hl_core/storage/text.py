"""Decoding user files (recipes, data): UTF-8, and where it is not, the place as ``file:line``."""

from __future__ import annotations

from typing import Callable


def decode_utf8(raw: bytes, path, error: Callable[[str, str], Exception]) -> str:
    """``raw`` as UTF-8 text; otherwise raises ``error(where, detail)``: ``where`` is ``path:line`` (1-based) of the
    first bad byte, ``detail`` names that byte and its column."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise error(f"{path}:{line}", f"byte 0x{raw[exc.start]:02x} at column {column}") from None
