"""The frozen reference's log-probs on disk (``train.cache_reference_logps``).

Layout: ``<output_dir>/reference_cache/rank<r>/`` holds ``manifest.json`` (the fingerprint and, per finished
part, its file and SHA-256) and one file per part (``updates-<a>-<b>.pt``: the batches of updates a..b;
``eval.pt``: the eval set). A part is written to a temporary name and renamed, then entered in the manifest
(also written whole and renamed), so a killed precompute leaves only finished parts behind: a rerun keeps
them and computes the rest. A part whose file is missing or whose checksum differs is computed again; a
different fingerprint discards the rank's cache and says which of its fields changed. A run extended to more
updates (``train.max_steps`` raised) computes only the updates the cache lacks. The cache reads, writes and
deletes only its own part files in its own directory: a manifest entry naming another path, or a symbolic link
at ``rank<r>``, is refused (exit code 2).

The fingerprint holds what the log-probs depend on: the model section and the content of a local model
directory's files (SHA-256; size and modification time for files over 256 MiB), the data section and the
content of its local files, the objective, precision and parallel layout, the batch layout (world size, seed,
micro-batch, accumulation: which batches each rank computes), the evaluation settings and the temperature; not
the number of updates (part files cover fixed update ranges). The recipe's part of it is read by
``hl_core.config.reference_cache_fields``; the cache adds its format, the temperature and the engine's layout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..errors import DiskFull, RecipeError
from ..storage.checkpoints import safe_load
from ..storage.digests import file_digest
from ..storage.disk_full import is_disk_full
from .sources import StoredReferenceLogps
from .store import LogpStore

FORMAT = 1
UPDATES_PER_PART = 32


def fingerprint(recipe_fields: Dict[str, object], world_size: int, dp_size: int, gradient_accumulation_steps: int,
                temperature: float = 1.0) -> Dict[str, object]:
    """What the cached log-probs depend on (flat ``{field: value}``, JSON-serialisable): the cache's format, the
    temperature, the recipe's fields (``hl_core.config.reference_cache_fields``) and the batch layout (which batches
    each rank computes)."""
    return {"format": FORMAT, "temperature": float(temperature), **recipe_fields, "world size": world_size,
            "data-parallel size": dp_size, "gradient accumulation steps": gradient_accumulation_steps}


def changed_fields(old: Dict[str, object], new: Dict[str, object]) -> List[str]:
    keys = sorted(set(old) | set(new))
    return [k for k in keys if old.get(k) != new.get(k)]


def update_parts(max_steps: int, per_part: int = UPDATES_PER_PART) -> List[Tuple[int, int]]:
    """``[(first, last), ...]`` update ranges, one per part file: parts start every ``per_part`` updates, the last
    one ends at the run's last update (extended in place when a later run asks for more updates)."""
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


def part_name(first: int, last: int) -> str:
    return f"updates-{first:06d}-{last:06d}"


_PART = re.compile(r"updates-(\d{6})-(\d{6})")
_PART_FILE = re.compile(r"(updates-\d{6}-\d{6}|eval)\.pt")  # the only files the cache writes (and deletes)


def _manifest_parts(manifest, path: Path) -> Dict[str, dict]:
    """The manifest's ``parts``, each a file the cache wrote in its own directory; an entry naming any other file
    (a path, ``../``) is refused: the cache reads and deletes only its own files."""
    parts = manifest.get("parts", {}) if isinstance(manifest, dict) else None
    if not isinstance(parts, dict):
        return {}
    for name, entry in parts.items():
        file = entry.get("file") if isinstance(entry, dict) else None
        if not isinstance(file, str) or not _PART_FILE.fullmatch(file) or file != f"{name}.pt":
            raise RecipeError(
                f"Refused the reference cache manifest `{path}`: its part `{name}` names the file `{file}`, not a "
                "part file of the cache's own directory (`updates-<first>-<last>.pt` or `eval.pt`), so reading or "
                f"cleaning it up could touch files outside the cache. Fix: delete `{path.parent}` (the cache is "
                "computed again), or set `train.cache_reference_logps=false`."
            )
    return dict(parts)


class ReferenceCacheDir:
    """One rank's cache directory (see the module docstring). It never follows a symbolic link out of the cache
    and deletes only the part files its manifest lists."""

    def __init__(self, directory: Path, fields: Dict[str, object]):
        self.directory, self.fields = Path(directory), fields
        self.manifest_path = self.directory / "manifest.json"
        self.parts: Dict[str, dict] = {}
        self.notices: List[str] = []  # why (part of) the cache is computed again, in order
        self._open()

    def _open(self) -> None:
        if self.directory.is_symlink():
            raise RecipeError(
                f"`{self.directory}` is a symbolic link (to `{os.readlink(self.directory)}`): the reference cache "
                "keeps its files in its own directory and deletes stale ones there, so it does not follow links out "
                "of it. Fix: remove the link (the cache is computed again), or point `output_dir` at the file system "
                "you meant (a link at `reference_cache` itself is followed)."
            )
        manifest = None
        if self.manifest_path.exists():
            try:
                manifest = json.loads(self.manifest_path.read_text())
            except (OSError, ValueError, RecursionError):
                manifest = None
            if not well_formed(manifest):
                manifest = None
                self.notices.append(f"{self.manifest_path} is unreadable: recomputing the reference cache")
        listed = _manifest_parts(manifest, self.manifest_path)
        if manifest is not None and not self.notices:
            fingerprint = manifest.get("fingerprint", {}) if isinstance(manifest, dict) else {}
            changed = changed_fields(fingerprint if isinstance(fingerprint, dict) else {}, self.fields)
            if changed:
                shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
                self.notices.append(f"the reference cache in {self.directory} was computed for a different run "
                                    f"({shown} changed): recomputing it")
            else:
                self.parts = listed
        if manifest is None or self.notices:
            self.directory.mkdir(parents=True, exist_ok=True)
            for entry in listed.values():  # only what this cache wrote (an unreadable manifest lists nothing)
                (self.directory / entry["file"]).unlink(missing_ok=True)
            self.parts = {}
            self._write_manifest()

    def valid(self, name: str) -> bool:
        """Part ``name`` is finished and its file's checksum matches (else it is computed again)."""
        entry = self.parts.get(name)
        if entry is None:
            return False
        path = self.directory / entry["file"]
        if not path.is_file() or path.is_symlink() or file_digest(path) != entry["sha256"]:
            self.notices.append(f"reference cache part {path} is missing or corrupted: computing it again")
            del self.parts[name]
            self._write_manifest()
            return False
        return True

    def prefix_of(self, first: int, last: int) -> int:
        """The last update of a valid part that starts at ``first`` and ends before ``last`` (a part an earlier,
        shorter run wrote), or -1."""
        for name in list(self.parts):
            match = _PART.fullmatch(name)
            if match and int(match.group(1)) == first and int(match.group(2)) < last and self.valid(name):
                return int(match.group(2))
        return -1

    def load(self, name: str) -> Dict[str, torch.Tensor]:
        return safe_load(self.directory / self.parts[name]["file"])

    def save(self, name: str, values: Dict[str, torch.Tensor], replaces: Optional[str] = None) -> None:
        """Write part ``name``; ``replaces``: a shorter part it extends, dropped once this one is listed."""
        path = self.directory / f"{name}.pt"
        tmp = path.with_name(path.name + ".partial")
        with _disk_full_named(tmp):
            torch.save(values, tmp)
        os.replace(tmp, path)
        self.parts[name] = {"file": path.name, "sha256": file_digest(path)}
        old = self.parts.pop(replaces, None) if replaces else None
        self._write_manifest()
        if old is not None:
            (self.directory / old["file"]).unlink(missing_ok=True)

    def _write_manifest(self) -> None:
        tmp = self.manifest_path.with_name("manifest.json.partial")
        with _disk_full_named(tmp):
            tmp.write_text(json.dumps({"fingerprint": self.fields, "parts": self.parts}, indent=1))
        os.replace(tmp, self.manifest_path)


@contextlib.contextmanager
def _disk_full_named(tmp: Path):
    """A full disk while ``tmp`` is written: the partial file removed (its space back), ``DiskFull`` naming it."""
    try:
        yield
    except (OSError, RuntimeError) as exc:
        if not is_disk_full(exc, tmp.parent):
            raise
        tmp.unlink(missing_ok=True)
        raise DiskFull(tmp, "the reference cache's") from exc


def _same_on_every_rank(engine, value: int) -> bool:
    """``value`` is the same integer on every rank (sum and sum of squares: equal iff n * sumsq == sum^2)."""
    sums = engine.all_reduce_sum(torch.tensor([1.0, float(value), float(value) ** 2], dtype=torch.float64)).tolist()
    return sums[0] * sums[2] == sums[1] ** 2


def load_or_compute(engine, cache: ReferenceCacheDir, ranges: List[Tuple[int, int]], batches_of_update,
                    eval_batches, temperature: float, progress: Optional[Callable[[int], None]] = None) -> LogpStore:
    """Every part's log-probs: read from ``cache`` when valid on every rank, else computed (on every rank: the
    forwards are collective) and written. ``ranges``: the update ranges of the parts; a part that a shorter run
    wrote (same first update, fewer updates) is extended by the missing updates only. ``eval_batches``: the eval
    set's part, or None. ``progress``: called with the updates each part covers."""
    store = LogpStore()
    parts = [(part_name(a, b), a, b) for a, b in ranges] + ([("eval", 0, -1)] if eval_batches is not None else [])
    for name, start, last in parts:
        first = start
        missing = torch.tensor([float(not cache.valid(name))], dtype=torch.float64)
        if engine.all_reduce_sum(missing).item() == 0:
            store.values.update(cache.load(name))
        else:
            part, replaces = LogpStore(), None
            done = cache.prefix_of(first, last) if name != "eval" else -1
            if done >= 0 and _same_on_every_rank(engine, done):
                replaces = part_name(first, done)
                part.values.update(cache.load(replaces))
                first = done + 1
            batches = eval_batches() if name == "eval" else (x for m in range(first, last + 1)
                                                                  for x in batches_of_update(m))
            part.fill(engine, batches, temperature)
            engine.synchronize()  # the fill's copies to the host are asynchronous: arrived before they are written
            cache.save(name, part.values, replaces)
            store.values.update(part.values)
        if progress is not None and name != "eval":
            progress(last - start + 1)
    return store


@dataclass(frozen=True)
class CacheLocation:
    """One rank's cache directory and the fingerprint its log-probs must match."""

    directory: Path
    fields: Dict[str, object]


def cache_location(output_dir: Path, recipe_fields: Dict[str, object], engine) -> CacheLocation:
    """``<output_dir>/reference_cache/rank<r>`` and the fingerprint of the recipe's fields
    (``hl_core.config.reference_cache_fields``) on this engine's layout."""
    fields = fingerprint(recipe_fields, engine.world_size, engine.dp_size, engine.gradient_accumulation_steps)
    return CacheLocation(Path(output_dir) / "reference_cache" / f"rank{engine.rank:05d}", fields)


def cached_reference(location: CacheLocation, max_steps: int, engine, reason: str, batches_of_update,
                     eval_batches, show_progress: bool, bars: bool = False) -> StoredReferenceLogps:
    """Every batch's reference log-probs for ``max_steps`` updates, computed by the untrained policy (sharded:
    each rank its own batches) or read from the cache at ``location``."""
    cache = ReferenceCacheDir(location.directory, location.fields)
    shown = len(cache.notices)  # the fingerprint's notice before the precompute, a torn part's after it
    for notice in cache.notices if show_progress else ():
        print(notice, flush=True)
    bar = None
    if show_progress and bars:
        from tqdm.auto import tqdm  # imported here: only rank 0 shows a bar

        bar = tqdm(total=max_steps, desc="reference log-probs", unit="update", dynamic_ncols=True)
    try:
        store = load_or_compute(engine, cache, update_parts(max_steps), batches_of_update, eval_batches, 1.0,
                                bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for notice in cache.notices[shown:] if show_progress else ():
        print(notice, flush=True)
    return StoredReferenceLogps(engine, "cached", reason, store)
