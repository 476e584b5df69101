"""The frozen reference's log-probs on disk (``train.cache_reference_logps``).

Layout: ``<output_dir>/reference_cache/rank<r>/`` holds ``manifest.json`` (the fingerprint and, per finished
part, its file and SHA-256) and one file per part (``updates-<a>-<b>.pt``: the batches of updates a..b;
``eval.pt``: the eval set). A part is written to a temporary name and renamed, then entered in the manifest
(also written whole and renamed), so a killed precompute leaves only finished parts behind: a rerun keeps
them and computes the rest. A part whose file is missing or whose checksum differs is computed again; a
different fingerprint discards the rank's cache and says which of its fields changed.

The fingerprint holds what the log-probs depend on: the model section and the content of a local model
directory's files (SHA-256; size and modification time for files over 256 MiB), the data section and the
content of its local files, the objective, precision and parallel layout, the batch layout (world size, seed,
micro-batch, accumulation, updates: which batches each rank computes), the evaluation settings and the
temperature.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..storage.checkpoints import safe_load
from .sources import StoredReferenceLogps
from .store import LogpStore

FORMAT = 1
UPDATES_PER_PART = 32
LARGE_FILE = 256 * 2**20


def sha256_file(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    """:func:`sha256_file`; for a file over 256 MiB its size and modification time (hashing model weights of
    tens of GiB at every start would cost minutes)."""
    stat = path.stat()
    if stat.st_size > LARGE_FILE:
        return f"size={stat.st_size},mtime_ns={stat.st_mtime_ns}"
    return sha256_file(path)


def _local_files(path: Optional[str]) -> Dict[str, str]:
    if not path or not Path(path).exists():
        return {}
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root) if root.is_dir() else p.name): file_digest(p) for p in files}


def fingerprint(recipe, world_size: int, dp_size: int, gradient_accumulation_steps: int,
                temperature: float = 1.0) -> Dict[str, object]:
    """What the cached log-probs depend on (flat ``{field: value}``, JSON-serialisable)."""
    data = recipe.data
    fields: Dict[str, object] = {"format": FORMAT, "temperature": float(temperature)}
    for key, value in recipe.model.model_dump(mode="json").items():
        fields[f"model.{key}"] = value
    for name, digest in _local_files(recipe.model.name_or_path).items():
        fields[f"model file {name}"] = digest
    if recipe.model.tokenizer:
        for name, digest in _local_files(recipe.model.tokenizer).items():
            fields[f"tokenizer file {name}"] = digest
    for key, value in data.model_dump(mode="json").items():
        fields[f"data.{key}"] = value
    for split, source in (("train", data.train), ("eval", data.eval)):
        for name, digest in _local_files(source.path if source is not None else None).items():
            fields[f"data.{split} file {name}"] = digest
    train = recipe.train
    fields.update({
        "objective.name": recipe.objective.name, "engine.name": recipe.engine.name,
        "engine.precision": recipe.engine.precision, "parallel.tp": recipe.parallel.tp, "parallel.pp": recipe.parallel.pp,
        "world size": world_size, "data-parallel size": dp_size, "train.seed": train.seed,
        "train.micro_batch_size": train.micro_batch_size, "gradient accumulation steps": gradient_accumulation_steps,
        "train.max_steps": train.max_steps, "train.logps_chunk_tokens": train.logps_chunk_tokens,
        "eval.every": recipe.eval.every, "eval.batch_size": recipe.eval.batch_size,
        "eval.max_batches": recipe.eval.max_batches,
    })
    return fields


def changed_fields(old: Dict[str, object], new: Dict[str, object]) -> List[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def update_parts(max_steps: int, per_part: int = UPDATES_PER_PART) -> List[Tuple[int, int]]:
    """``[(first, last), ...]`` update ranges, one per part file."""
    return [(a, min(a + per_part, max_steps) - 1) for a in range(0, max_steps, per_part)]


def well_formed(manifest) -> bool:
    """``manifest`` has the shape this module writes: ``{"fingerprint": {...}, "parts": {name: {"file": str,
    "sha256": str}}}`` (anything else, e.g. a hand-edited or foreign file, is unreadable: the cache is recomputed)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("fingerprint"), dict):
        return False
    parts = manifest.get("parts", {})
    return isinstance(parts, dict) and all(
        isinstance(entry, dict) and isinstance(entry.get("file"), str) and isinstance(entry.get("sha256"), str)
        for entry in parts.values())


class ReferenceCacheDir:
    """One rank's cache directory (see the module docstring)."""

    def __init__(self, directory: Path, fields: Dict[str, object]):
        self.directory, self.fields = Path(directory), fields
        self.manifest_path = self.directory / "manifest.json"
        self.parts: Dict[str, dict] = {}
        self.notices: List[str] = []  # why (part of) the cache is computed again, in order
        self._open()

    def _open(self) -> None:
        manifest = None
        if self.manifest_path.exists():
            try:
                manifest = json.loads(self.manifest_path.read_text())
            except (OSError, ValueError, RecursionError):
                manifest = None
            if not well_formed(manifest):
                manifest = None
                self.notices.append(f"{self.manifest_path} is unreadable: recomputing the reference cache")
        if manifest is not None:
            changed = changed_fields(manifest.get("fingerprint", {}), self.fields)
            if changed:
                shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
                self.notices.append(f"the reference cache in {self.directory} was computed for a different run "
                                    f"({shown} changed): recomputing it")
            else:
                self.parts = dict(manifest.get("parts", {}))
        if manifest is None or self.notices:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob("*.pt"):
                stale.unlink()
            self.parts = {}
            self._write_manifest()

    def valid(self, name: str) -> bool:
        """Part ``name`` is finished and its file's checksum matches (else it is computed again)."""
        entry = self.parts.get(name)
        if entry is None:
            return False
        path = self.directory / entry["file"]
        if not path.exists() or file_digest(path) != entry["sha256"]:
            self.notices.append(f"reference cache part {path} is missing or corrupted: computing it again")
            del self.parts[name]
            self._write_manifest()
            return False
        return True

    def load(self, name: str) -> Dict[str, torch.Tensor]:
        return safe_load(self.directory / self.parts[name]["file"])

    def save(self, name: str, values: Dict[str, torch.Tensor]) -> None:
        path = self.directory / f"{name}.pt"
        tmp = path.with_name(path.name + ".partial")
        torch.save(values, tmp)
        os.replace(tmp, path)
        self.parts[name] = {"file": path.name, "sha256": file_digest(path)}
        self._write_manifest()

    def _write_manifest(self) -> None:
        tmp = self.manifest_path.with_name("manifest.json.partial")
        tmp.write_text(json.dumps({"fingerprint": self.fields, "parts": self.parts}, indent=1))
        os.replace(tmp, self.manifest_path)


def load_or_compute(engine, cache: ReferenceCacheDir, parts: List[Tuple[str, Callable[[], list]]], units: List[int],
                    temperature: float, progress: Optional[Callable[[int], None]] = None) -> LogpStore:
    """Every part's log-probs: read from ``cache`` when valid on every rank, else computed (on every rank: the
    forwards are collective) and written. ``parts``: ``(name, batches)``; ``units``: progress per part."""
    store = LogpStore()
    for (name, batches), unit in zip(parts, units):
        missing = torch.tensor([float(not cache.valid(name))], dtype=torch.float64)
        if engine.all_reduce_sum(missing).item() > 0:
            part = LogpStore()
            part.fill(engine, batches(), temperature)
            cache.save(name, part.values)
            store.values.update(part.values)
        else:
            store.values.update(cache.load(name))
        if progress is not None:
            progress(unit)
    return store


@dataclass(frozen=True)
class CacheLocation:
    """One rank's cache directory and the fingerprint its log-probs must match."""

    directory: Path
    fields: Dict[str, object]


def cache_location(recipe, engine) -> CacheLocation:
    """``<output_dir>/reference_cache/rank<r>`` and the recipe's fingerprint on this engine's layout."""
    fields = fingerprint(recipe, engine.world_size, engine.dp_size, engine.gradient_accumulation_steps)
    return CacheLocation(Path(recipe.output_dir) / "reference_cache" / f"rank{engine.rank:05d}", fields)


def cached_reference(location: CacheLocation, max_steps: int, engine, reason: str, batches_of_update,
                     eval_batches, show_progress: bool) -> StoredReferenceLogps:
    """Every batch's reference log-probs for ``max_steps`` updates, computed by the untrained policy (sharded:
    each rank its own batches) or read from the cache at ``location``."""
    cache = ReferenceCacheDir(location.directory, location.fields)
    shown = len(cache.notices)  # the fingerprint's notice before the precompute, a torn part's after it
    for notice in cache.notices if show_progress else ():
        print(notice, flush=True)
    parts, units = [], []
    for first, last in update_parts(max_steps):
        parts.append((f"updates-{first:06d}-{last:06d}",
                      lambda a=first, b=last: [x for m in range(a, b + 1) for x in batches_of_update(m)]))
        units.append(last - first + 1)
    if eval_batches is not None:
        parts.append(("eval", lambda: list(eval_batches())))
        units.append(0)
    bar = None
    if show_progress:
        from tqdm.auto import tqdm  # imported here: only rank 0 shows a bar

        bar = tqdm(total=max_steps, desc="reference log-probs", unit="update", dynamic_ncols=True)
    try:
        store = load_or_compute(engine, cache, parts, units, 1.0, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for notice in cache.notices[shown:] if show_progress else ():
        print(notice, flush=True)
    return StoredReferenceLogps(engine, "cached", reason, store)
