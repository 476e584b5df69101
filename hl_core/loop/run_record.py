"""What a checkpoint was written with (its run record, kept in its ``complete.json``), and what a resume may change.

A resume compares the checkpoint's record with this run's, before the engine is built:

* refused (one paragraph naming each change and the fix, exit code 2): another objective, model shape (or LoRA
  setting), precision (DeepSpeed's fp32 and bf16 optimizer states differ), or number of examples per update
  (the data stream is consumed that many examples per update: another number moves every later update's data),
  or training data whose files hold other bytes (the record keeps each training file's SHA-256, hashed once per
  run; the paragraph names the file: restore it, or start afresh);
* allowed, one line each: more updates (``train.max_steps`` raised: the learning rate follows the new
  ``train.max_steps``'s schedule from the update reached), another path to the same training files, other data
  settings or seed (the run continues at the same stream position of the new seeded order), new eval data (the
  held-out history before the resume, measured on the other set, is dropped), another split of the same
  examples into micro-batches;
* a checkpoint without a record (an older version, or ``complete.json`` emptied by hand) is resumed unchecked,
  with one line saying so.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..config import batch_layout
from ..engines.base import lr_lambda
from ..errors import RecipeError, UserError
from ..models.specs import resolve_spec
from ..storage.checkpoints import read_marker
from ..storage.digests import content_digests, local_files

FORMAT = 1
MODEL_DIMS = ("model_type", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "intermediate_size",
              "head_dim")


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _model(recipe) -> Dict[str, object]:
    """The model's name and overrides, and its dimensions where they are known without a download."""
    try:
        spec = resolve_spec(recipe.model)
        dims = {key: getattr(spec, key) for key in MODEL_DIMS}
    except UserError:  # a hub model not in the local cache (yet): its name and overrides stand in for its shape
        dims = None
    return {"name_or_path": recipe.model.name_or_path, "config_overrides": dict(recipe.model.config_overrides),
            "dims": dims}


def _changed(key: str, saved, now) -> bool:
    """The model: its dimensions when both records know them (another path to the same shape is fine), else its
    name and overrides."""
    if key == "model" and isinstance(saved, dict) and isinstance(now, dict):
        if saved.get("dims") and now.get("dims"):
            return saved["dims"] != now["dims"]
        named = ("name_or_path", "config_overrides")
        return [saved.get(k) for k in named] != [now[k] for k in named]
    return saved != now


def _data(data, split: str, train_files: List[Dict[str, str]]) -> Optional[str]:
    """One digest of a split's sources, settings and files (``train_files``: the training sources' digests)."""
    source = getattr(data, split)
    if source is None and not (split == "eval" and data.eval_fraction):
        return None
    rest = data.model_dump(mode="json", exclude={"train", "eval"})
    # no eval source: carved from the train data (each source of a `data.train` mixture)
    files = train_files if source is None or split == "train" else [local_files(source.path)]
    dumped = [s.model_dump(mode="json") for s in source] if isinstance(source, list) else (
        source.model_dump(mode="json") if source is not None else None)
    return _digest({"source": dumped, "settings": rest, "files": files[0] if len(files) == 1 else files,
                    "split": split})


def _train_files(data) -> List[Dict[str, object]]:
    """Each training source's path and its files' SHA-256 (hashed in full, once per run: ``content_digests``)."""
    return [{"path": source.path, "files": content_digests(source.path)} for source in data.train_sources]


def run_record(recipe, world_size: int) -> Dict[str, object]:
    """This run's record (JSON-serialisable): what a checkpoint it writes holds and what its data stream is."""
    dp, accumulation = batch_layout(recipe, world_size)
    train, lora = recipe.train, recipe.model.lora
    train_files = _train_files(recipe.data)
    digests = [source["files"] for source in train_files]
    return {
        "format": FORMAT,
        "objective": recipe.objective.name,
        "model": _model(recipe),
        # the adapter's shape and the base it is rebuilt on (not `save_merged`, `alpha` or `dropout`: free to change)
        "lora": ({"base": recipe.model.name_or_path, "r": lora.r, "target_modules": lora.target_modules}
                 if recipe.model.lora_enabled else None),
        "precision": recipe.engine.precision,
        "examples_per_update": train.micro_batch_size * accumulation * dp,
        "micro_batch_size": train.micro_batch_size,
        "max_steps": train.max_steps,
        "lr_schedule": [train.lr_schedule, train.warmup_steps],
        "seed": train.seed,
        "data_train": _data(recipe.data, "train", digests),
        "data_train_files": train_files,
        "data_eval": _data(recipe.data, "eval", digests),
    }


# refused changes: record key -> (the recipe key a user sets, why it cannot continue)
REFUSED = {
    "objective": ("objective.name", "its optimizer state, reference and metrics belong to that objective: continuing "
                  "it under another would mix two objectives in one run"),
    "model": ("model.name_or_path / model.config_overrides", "its weights do not fit a model of another shape"),
    "lora": ("model.lora", "its trainable weights are another adapter (or none)"),
    "precision": ("engine.precision", "the optimizer state differs between fp32 and bf16 (bf16 keeps fp32 master "
                  "weights and a loss scaler), so one cannot be loaded as the other"),
    "examples_per_update": ("train.micro_batch_size x accumulation x data-parallel size",
                            "the data stream is consumed that many examples per update, so another number would "
                            "move every later update onto other examples"),
}


def _where(path: str, files: Dict[str, str], name: str) -> str:
    """The path of file ``name`` of a source at ``path`` (a single file, or a directory of ``files``)."""
    return path if list(files) == [Path(path).name] else f"{path}/{name}"


def _source_change(key: str, old: Dict, new: Dict) -> str:
    """What differs between a training source at the checkpoint (``old``) and now (``new``), naming the file."""
    old_path, new_path = str(old.get("path")), str(new["path"])
    old_files, new_files = old.get("files") or {}, new["files"]
    moved = f"`{key}` was `{old_path}`, this run has `{new_path}`"
    if not old_files or not new_files:  # a hub dataset on one side: compared by name
        return moved
    if len(old_files) == len(new_files) == 1 and _where(old_path, old_files, "") == old_path:  # one file each
        (old_sha,), (new_sha,) = old_files.values(), new_files.values()
        what = f"`{new_path}` changed since the checkpoint" if old_path == new_path else moved
        return f"{what} (SHA-256 {old_sha[:12]}... then, {new_sha[:12]}... now)"
    changed = sorted(n for n in old_files.keys() & new_files.keys() if old_files[n] != new_files[n])
    parts = [f"`{_where(new_path, new_files, n)}` changed since the checkpoint (SHA-256 {old_files[n][:12]}... "
             f"then, {new_files[n][:12]}... now)" for n in changed[:3]]
    parts += [f"`{_where(old_path, old_files, n)}` is gone" for n in sorted(old_files.keys() - new_files.keys())[:3]]
    parts += [f"`{_where(new_path, new_files, n)}` is new" for n in sorted(new_files.keys() - old_files.keys())[:3]]
    return (f"{moved}: " if old_path != new_path else "") + "; ".join(parts)


def train_data_change(saved, now: List[Dict]) -> str:
    """'' when each training source holds the same bytes as at the checkpoint (another path to them is fine; a
    hub dataset: the same name), or the checkpoint's record has no digests (an older version); else what changed,
    naming the file."""
    if not isinstance(saved, list):
        return ""
    if len(saved) != len(now):
        return f"`data.train` had {len(saved)} source(s) at the checkpoint, this run has {len(now)}"
    for i, (old, new) in enumerate(zip(saved, now)):
        if old.get("files") == new["files"] and (new["files"] or old.get("path") == new["path"]):
            continue
        return _source_change("data.train.path" if len(now) == 1 else f"data.train[{i}].path", old, new)
    return ""


@dataclass
class ResumeCheck:
    """What a resume found: the lines to print, and whether the held-out history must start again."""

    notices: List[str] = field(default_factory=list)
    eval_changed: bool = False


def _shown(value) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def check_resume_record(checkpoint: Path, resume: str, record: Dict[str, object]) -> ResumeCheck:
    """Compare ``checkpoint`` (which ``checkpoint.resume: resume`` chose)'s record with this run's ``record``; raises
    ``RecipeError`` on a refused change."""
    marker = read_marker(checkpoint)
    where = f"`checkpoint.resume: {resume}` took `{checkpoint}`"
    updates, max_steps = marker.get("updates_done"), record["max_steps"]
    if isinstance(updates, int) and updates > max_steps:
        raise RecipeError(
            f"{where}, which holds {updates} updates, more than this run's `train.max_steps: {max_steps}`:"
            f" a run cannot be shortened. Fix: set `train.max_steps` to {updates} or more, point `checkpoint.resume` "
            "at an earlier `step_N`, or start afresh in another `output_dir`."
        )
    saved = marker.get("run")
    if not saved:
        return ResumeCheck([f"`{checkpoint}` has no run record (an older version wrote it, or its complete.json was "
                            "emptied): resumed without checking that it was written with this recipe."])
    changes = [key for key in REFUSED if _changed(key, saved.get(key), record.get(key))]
    if changes:
        what = "; ".join(f"`{REFUSED[k][0]}` was {_shown(saved.get(k))}, this run has {_shown(record.get(k))}: "
                         f"{REFUSED[k][1]}" for k in changes)
        raise RecipeError(
            f"{where}, which was written by another kind of run: {what}. Fix: set those keys back to continue it, "
            "or start a new run in another `output_dir` (from its weights: `model.name_or_path=<that "
            "output_dir>/final`), or here with `checkpoint.resume=never checkpoint.overwrite=true`."
        )
    changed = train_data_change(saved.get("data_train_files"), record["data_train_files"])
    if changed:
        raise RecipeError(
            f"{where}, which was trained on other data: {changed}. Its {updates} updates consumed the start of that "
            "data's seeded order, and the same position in other data holds other examples. Fix: restore the "
            "training data as it was to continue this run, or start afresh: `checkpoint.resume=never "
            "checkpoint.overwrite=true` here (deletes this run's checkpoints and `final/`), or another `output_dir`."
        )
    check = ResumeCheck()
    if saved.get("max_steps") != record["max_steps"]:
        check.notices.append(_extension_line(saved, record, updates))
    if saved.get("data_train") != record["data_train"] or saved.get("seed") != record["seed"]:
        check.notices.append(
            f"The training data's settings or path, or `train.seed`, changed since `{checkpoint.name}` (its files "
            f"did not): this run continues at update {updates} from the same position ({updates} x "
            f"{record['examples_per_update']} examples) of the new seeded order.")
    if saved.get("data_eval") != record["data_eval"]:
        check.eval_changed = True
        check.notices.append("The eval data changed since the checkpoint: the held-out results before the resume "
                             "(another set) are dropped from this run's start -> end summary.")
    return check


def _extension_line(saved: Dict, record: Dict, updates) -> str:
    old, new = saved.get("max_steps"), record["max_steps"]
    line = f"`train.max_steps` is {new} (the checkpoint's run had {old}): continuing from update {updates}"
    schedule, warmup = record["lr_schedule"]
    if schedule == "constant" or not isinstance(updates, int) or not isinstance(old, int):
        return line + "."
    now, before = lr_lambda(warmup, new, schedule)(updates), lr_lambda(warmup, old, schedule)(updates)
    return (f"{line}; the learning rate follows the `{schedule}` schedule of the new `train.max_steps` from there "
            f"({now:.3f} x `train.lr` at update {updates}, where the old schedule was at {before:.3f}).")
