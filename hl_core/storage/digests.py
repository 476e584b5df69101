"""Digests of files on disk: what a cached reference or a checkpoint's run record depends on."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict, Optional

LARGE_FILE = 256 * 2**20


def sha256_file(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """`sha256_file`; for a file over 256 MiB its size and modification time (hashing model weights of
    tens of GiB at every start would cost minutes)."""
    stat = path.stat()
    if stat.st_size > LARGE_FILE:
        return f"size={stat.st_size},mtime_ns={stat.st_mtime_ns}"
    return sha256_file(path)


def local_files(path: Optional[str]) -> Dict[str, str]:
    """``{name: file_digest}`` of a local file, or of every file under a local directory; ``{}`` for anything else
    (a hub name)."""
    if not path or not Path(path).exists():
        return {}
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root) if root.is_dir() else p.name): file_digest(p) for p in files}


def content_digests(path: Optional[str]) -> Dict[str, str]:
    """``{name: sha256_file}`` of a local file, or of every file under a local directory, each hashed in full
    whatever its size (training data: a copy or a ``touch`` must not read as a change); ``{}`` for anything else
    (a hub name). Measured: 6.2 s per GiB on a loaded 2-core machine."""
    if not path or not Path(path).exists():
        return {}
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root) if root.is_dir() else p.name): sha256_file(p) for p in files}
