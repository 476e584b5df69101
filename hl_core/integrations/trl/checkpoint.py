"""The humanline trainers' part of TRL's checkpoints, and the resume door: everything a resume reads is checked
before anything is loaded.

Written into each ``checkpoint-N/`` (``save``), each file checksummed and renamed into place when whole:

* ``humanline_sync_rank<r>.pt`` (each rank its own): the sync's ``ReferenceSync.state_dict()`` (its counts and this
  rank's shards of the reference that syncing moved) and the transform's state (``SampleTransform``'s generators);
* ``humanline_state.json`` (rank 0): the humanline settings the run trained with, the sync marks and the per-update
  rows of ``humanline_history``.

``read_resume`` runs before transformers touches the checkpoint, and refuses in one paragraph (naming the file, what
is wrong and the fix), changing nothing, when:

* a file a resume reads holds anything but weights (a pickle naming code: nothing of it runs), or is damaged:
  every ``.pt``/``.pth``/``.bin`` (DeepSpeed's included) but ``training_args.bin``, which transformers writes and
  never reads back, every JSON file a resume reads, every ``.safetensors`` header, DeepSpeed's ``latest``;
* the checkpoint is of another model size (its ``config.json`` or weight shapes against the model being trained);
* a humanline file is missing, fails its checksum, or holds other keys, types, shapes, dtypes, non-finite values,
  counts, or settings than this trainer's.

Under DeepSpeed the engine's own loads also go through a weights-only checkpoint engine (``install_safe_engine``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from hl_core.humanline import SampleTransform
from hl_core.humanline.sync import _unwrap
from hl_core.storage.checkpoints import refusal
from hl_core.storage.deepspeed_checkpoints import deepspeed_safe_globals, safe_checkpoint_engine

from .compat import HumanlineTrlSettingError

SYNC_FILE = "humanline_sync_rank{rank}.pt"
STATE_FILE = "humanline_state.json"
FORMAT = 1
NEVER_READ = ("training_args.bin",)  # transformers' pickled arguments: written with each checkpoint, never loaded
READ_JSON = ("trainer_state.json", "config.json", "adapter_config.json", STATE_FILE, "model.safetensors.index.json")
PICKLED = (".pt", ".pth", ".bin")
SIZE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "moe_intermediate_size")


@dataclass
class Resume:
    """What ``read_resume`` found valid, applied when training starts (``HumanlineSyncCallback.on_train_begin``)."""

    sync: Optional[Dict[str, Any]]
    transform: Optional[Dict[str, torch.Tensor]]
    rows: Optional[Dict[str, Any]]


def _refuse(checkpoint, what: str, fix: Optional[str] = None) -> HumanlineTrlSettingError:
    fix = fix or ("resume from a checkpoint this trainer wrote, intact (an earlier `checkpoint-N`, or copy it "
                  "again), or start a fresh run")
    return HumanlineTrlSettingError(f"cannot resume from `{checkpoint}`: {what}. Nothing was loaded: the model, "
                                    f"the reference and the trainer are as they were. Fix: {fix}.")


# ------------------------------------------------------------------------------------------------------ digests
def _feed(hasher, value) -> None:
    """A canonical encoding of nested dicts, lists, tensors and scalars into ``hasher``."""
    if isinstance(value, dict):
        hasher.update(b"{")
        for key in sorted(value, key=str):
            hasher.update(repr(str(key)).encode())
            _feed(hasher, value[key])
        hasher.update(b"}")
    elif isinstance(value, (list, tuple)):
        hasher.update(b"[")
        for item in value:
            _feed(hasher, item)
        hasher.update(b"]")
    elif isinstance(value, torch.Tensor):
        tensor = value.detach().cpu().contiguous()
        hasher.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
        hasher.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    else:
        hasher.update(repr(value).encode())


def digest(value) -> str:
    """SHA-256 of ``value`` (nested dicts, lists, tensors and scalars), independent of dict order."""
    hasher = hashlib.sha256()
    _feed(hasher, value)
    return hasher.hexdigest()


def _replace_into(path: str, write) -> None:
    """``write(tmp)`` then rename onto ``path``: a reader sees the old file or the whole new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    write(tmp)
    os.replace(tmp, path)


def save(folder: str, rank: int, sync_state, transform_state, rows: Optional[dict]) -> None:
    """Write this rank's sync file and, with ``rows`` (rank 0), the state file, each with its checksum."""
    payload = {"format": FORMAT, "sync": sync_state, "transform": transform_state}
    payload["checksum"] = digest(payload)
    _replace_into(os.path.join(folder, SYNC_FILE.format(rank=rank)), lambda tmp: torch.save(payload, tmp))
    if rows is not None:
        state = {"format": FORMAT, **rows}
        state["checksum"] = digest(state)

        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(state, f)

        _replace_into(os.path.join(folder, STATE_FILE), write)


# ------------------------------------------------------------------------------------------- files a resume reads
def _deepspeed_globals() -> list:
    """The classes DeepSpeed's checkpoint files hold besides tensors and containers (its loss scaler, ZeRO enums and
    fragment addresses: ``hl_core.storage.deepspeed_checkpoints.deepspeed_safe_globals``): nothing with code to run."""
    try:
        return deepspeed_safe_globals()
    except ImportError:  # no DeepSpeed: its files cannot be in a checkpoint this environment resumes
        return []


def _pickle_problem(path: Path) -> Optional[str]:
    """Why the pickled ``path`` may not be loaded (it names code, or it is no ``torch.save`` archive), or None.
    Only the archive's pickle is read, never run; allowed besides weights: what transformers allows in its RNG
    states (numpy) and DeepSpeed's classes."""
    from transformers.trainer_pt_utils import safe_globals  # transformers loads only when a resume reads a file

    try:
        with safe_globals(), torch.serialization.safe_globals(_deepspeed_globals()):
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (ValueError, RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        return f"is not a readable `torch.save` archive ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
    if unsafe:
        shown = ", ".join(f"`{name}`" for name in unsafe[:3])
        return f"is a pickle that names {shown}: code, not weights (nothing of it ran)"
    return None


def _json_problem(path: Path) -> Optional[str]:
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"is not valid JSON ({type(exc).__name__}: {str(exc)[:100]})"
    return None


def _safetensors_shapes(path: Path) -> Dict[str, tuple]:
    from safetensors import safe_open  # read only for LoRA resumes

    with safe_open(str(path), framework="pt") as f:
        return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}


def _safetensors_problem(path: Path) -> Optional[str]:
    try:
        _safetensors_shapes(path)
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types for a bad header)
        return f"is not a readable safetensors file ({type(exc).__name__}: {str(exc).splitlines()[0][:100]})"
    return None


def _latest_problem(path: Path) -> Optional[str]:
    try:
        tag = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        return f"is not DeepSpeed's tag file ({type(exc).__name__})"
    if not tag or "/" in tag or not (path.parent / tag).is_dir():
        return "does not name a DeepSpeed checkpoint folder beside it"
    return None


def file_problems(checkpoint: Path) -> List[str]:
    """``file: problem`` for each file of ``checkpoint`` a resume would read that holds code or is damaged."""
    problems = []
    for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
        check = None
        if path.name in NEVER_READ:
            continue
        if path.suffix in PICKLED:
            check = _pickle_problem
        elif path.name in READ_JSON:
            check = _json_problem
        elif path.suffix == ".safetensors":
            check = _safetensors_problem
        elif path.name == "latest":
            check = _latest_problem
        problem = check(path) if check else None
        if problem:
            problems.append(f"`{path.relative_to(checkpoint)}` {problem}")
    return problems


# ------------------------------------------------------------------------------------------------- model size
def _shapes(model) -> Dict[str, tuple]:
    return {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in _unwrap(model).named_parameters()}


def _config_of(model) -> dict:
    model = _unwrap(model)
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(base, "config", None)
    return config.to_dict() if config is not None else {}


def size_problem(checkpoint: Path, model) -> Optional[str]:
    """How the checkpoint's model differs in size from ``model`` (a ``config.json`` key, or a weight's shape),
    or None."""
    saved_config = checkpoint / "config.json"
    if saved_config.is_file():
        saved, mine = json.loads(saved_config.read_text()), _config_of(model)
        if not isinstance(saved, dict):
            return f"its `config.json` holds a {type(saved).__name__}, not a model's config"
        for key in SIZE_KEYS:
            if key in saved and key in mine and saved[key] != mine[key]:
                return (f"its model has `{key}: {saved[key]}` in `config.json` where the model being trained has "
                        f"{mine[key]}")
    shapes = _shapes(model)
    adapters = {name.replace(".default.", "."): shape for name, shape in shapes.items()}  # PEFT saves it so
    for path in sorted(checkpoint.glob("*.safetensors")):
        for key, shape in _safetensors_shapes(path).items():
            mine = shapes.get(key, adapters.get(key))
            if mine is not None and tuple(mine) != tuple(shape):
                return f"`{path.name}` holds `{key}` of shape {tuple(shape)} where the model being trained has {mine}"
    return None


# ------------------------------------------------------------------------------------------------ humanline files
def _load_rank_file(checkpoint: Path, path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:
        raise _refuse(checkpoint, f"`{path.name}` cannot be read ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100] if str(exc) else 'empty or cut short'})") from None
    if not isinstance(payload, dict) or set(payload) != {"format", "sync", "transform", "checksum"}:
        keys = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise _refuse(checkpoint, f"`{path.name}` holds {keys}, not the humanline trainer's sync file (format "
                      f"{FORMAT}: `format`, `sync`, `transform`, `checksum`)")
    checksum = payload.pop("checksum")
    if payload["format"] != FORMAT or checksum != digest(payload):
        raise _refuse(checkpoint, f"`{path.name}` fails its checksum (format {payload['format']!r}): its bytes "
                      "changed after it was written")
    return payload


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_sync(checkpoint: Path, name: str, sync, expected: Dict[str, torch.Tensor], schedule, step: int) -> None:
    """The saved ``ReferenceSync.state_dict()`` against this trainer: counts, schedule, and each shard's name,
    dtype, shape (where the layout is final already) and finiteness."""
    keys = {"updates_seen", "num_syncs", "schedule", "reference_shards"}  # ReferenceSync.state_dict()'s, at least
    if not isinstance(sync, dict) or not keys <= set(sync):
        raise _refuse(checkpoint, f"`{name}` holds a sync state with keys "
                      f"{sorted(sync) if isinstance(sync, dict) else type(sync).__name__}, not {sorted(keys)}")
    seen, done = sync["updates_seen"], sync["num_syncs"]
    if not (_is_count(seen) and _is_count(done) and done <= seen) or seen != step:
        raise _refuse(checkpoint, f"`{name}` counts {seen!r} updates and {done!r} syncs, where the checkpoint's "
                      f"`trainer_state.json` is at update {step}")
    mine = {"every": schedule.every, "offset": schedule.offset, "mix": schedule.mix}
    if sync["schedule"] != mine:
        raise _refuse(checkpoint, f"`{name}` was written with the sync schedule {sync['schedule']} and this trainer "
                      f"has {mine}", "resume with the schedule that wrote the checkpoint (SyncSchedule, or the "
                      "config's `humanline_sync_freq`, `humanline_sync_offset`, `humanline_sync_mix`), or start "
                      "a fresh run")
    shards = sync["reference_shards"]
    if not isinstance(shards, dict) or set(shards) != set(expected):
        extra = sorted(set(shards) - set(expected))[:2] if isinstance(shards, dict) else []
        lost = sorted(set(expected) - set(shards))[:2] if isinstance(shards, dict) else []
        raise _refuse(checkpoint, f"`{name}` holds reference shards of other parameters than this trainer's "
                      f"reference (extra {extra}, missing {lost})", "resume with the model and the reference "
                      "(or LoRA adapter) that wrote the checkpoint, or start a fresh run")
    for key, shard in shards.items():
        local = expected[key]  # None: the layout is set when training starts (checked then)
        wrong = None
        if not isinstance(shard, torch.Tensor):
            wrong = f"a {type(shard).__name__}, not a tensor"
        elif local is not None and shard.dtype != local.dtype:
            wrong = f"{shard.dtype} where the reference holds {local.dtype}"
        elif local is not None and tuple(shard.shape) != tuple(local.shape):
            wrong = f"shape {tuple(shard.shape)} where this rank's shard is {tuple(local.shape)}"
        elif shard.is_floating_point() and not bool(torch.isfinite(shard).all()):
            wrong = "NaN or inf"
        if wrong:
            raise _refuse(checkpoint, f"`{name}` holds a reference shard `{key}` of {wrong}", "resume on the layout "
                          "that saved it (the same ZeRO stage and number of processes), from an intact checkpoint, "
                          "or start a fresh run")


def _generator_problem(device: str, state) -> Optional[str]:
    """Why ``state`` cannot be a generator state on ``device`` here, or None."""
    try:
        generator = torch.Generator(device=torch.device(device))
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"a generator state for device `{device}`, which this process cannot use ({str(exc)[:80]})"
    expected = generator.get_state()
    if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.shape != expected.shape:
        return f"a generator state for `{device}` that is no such state ({getattr(state, 'shape', type(state))})"
    return None


def _check_transform(checkpoint: Path, name: str, saved, transform) -> None:
    """The transform's saved state (``SampleTransform``'s generators, per device; ``{}`` or None for a transform
    that keeps none) against this trainer's transform."""
    if not isinstance(transform, SampleTransform):
        if saved:
            raise _refuse(checkpoint, f"`{name}` holds a transform state ({type(saved).__name__}) that this "
                          f"trainer's transform ({type(transform).__name__}) does not keep")
        return
    if not isinstance(saved, dict):
        raise _refuse(checkpoint, f"`{name}` holds no generator state for this trainer's SampleTransform (it holds "
                      f"{type(saved).__name__})", "resume from a checkpoint written with humanline sampling")
    for device, state in saved.items():
        problem = _generator_problem(str(device), state)
        if problem:
            raise _refuse(checkpoint, f"`{name}` holds {problem}", "resume on the kind of device that saved the "
                          "checkpoint, from an intact checkpoint, or start a fresh run")


def _check_rows(checkpoint: Path, rows, settings: dict) -> None:
    """``humanline_state.json``: its checksum, its settings against this trainer's, and its rows' types."""
    if not isinstance(rows, dict) or set(rows) != {"format", "settings", "synced_updates", "history", "checksum"}:
        raise _refuse(checkpoint, f"`{STATE_FILE}` holds {sorted(rows) if isinstance(rows, dict) else rows!r}, not "
                      f"the humanline trainer's state (format {FORMAT})")
    checksum = rows.pop("checksum")
    if rows["format"] != FORMAT or checksum != digest(rows):
        raise _refuse(checkpoint, f"`{STATE_FILE}` fails its checksum: its bytes changed after it was written")
    if not isinstance(rows["settings"], dict):
        raise _refuse(checkpoint, f"`{STATE_FILE}` holds settings of type {type(rows['settings']).__name__}")
    for key in sorted(set(rows["settings"]) | set(settings)):
        if rows["settings"].get(key) != settings.get(key):
            raise _refuse(checkpoint, f"it was trained with `{key}` = {rows['settings'].get(key)!r} and this trainer "
                          f"has {settings.get(key)!r}", "build the trainer with the settings that wrote the "
                          "checkpoint (the same config fields or `transform=`/`schedule=`), or start a fresh run")
    marks, history = rows["synced_updates"], rows["history"]
    if not (isinstance(marks, list) and all(_is_count(n) for n in marks) and isinstance(history, list)
            and all(isinstance(r, dict) and _is_count(r.get("update")) for r in history)):
        raise _refuse(checkpoint, f"`{STATE_FILE}` holds sync marks or rows of the wrong types")


def _global_step(checkpoint: Path) -> int:
    path = checkpoint / "trainer_state.json"
    if not path.is_file():
        raise _refuse(checkpoint, "it holds no `trainer_state.json` (not a checkpoint a Trainer wrote)",
                      "point `resume_from_checkpoint` at a `checkpoint-N` folder")
    state = json.loads(path.read_text())
    step = state.get("global_step") if isinstance(state, dict) else None
    if not _is_count(step):
        raise _refuse(checkpoint, f"`trainer_state.json` holds `global_step: {step!r}`")
    return step


def read_resume(trainer, checkpoint) -> Optional[Resume]:
    """Check everything a resume from ``checkpoint`` reads, then read the humanline files (None without humanline).

    Raises:
        HumanlineTrlSettingError: one paragraph naming the file and the fix; nothing was loaded or changed.
    """
    checkpoint = Path(checkpoint)
    if not checkpoint.is_dir():
        raise _refuse(checkpoint, "it is not a folder", "point `resume_from_checkpoint` at a `checkpoint-N` folder")
    problems = file_problems(checkpoint)
    if problems:
        raise _refuse(checkpoint, f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    step = _global_step(checkpoint)
    problem = size_problem(checkpoint, trainer.model)
    if problem:
        raise _refuse(checkpoint, f"it is a checkpoint of another model: {problem}", "resume with the model (size, "
                      "architecture, LoRA rank) that wrote it, or start a fresh run from this model")
    if not trainer.humanline_enabled:
        return None
    sync_path = checkpoint / SYNC_FILE.format(rank=trainer.args.process_index)
    schedule, transform = trainer.humanline_sync.schedule, trainer.humanline_transform
    syncing = schedule is not None and schedule.every is not None
    if not sync_path.is_file():
        if syncing or isinstance(transform, SampleTransform):
            raise _refuse(checkpoint, f"it holds no `{sync_path.name}`: the moved reference, the sync's counts and "
                          "the transform's state this rank needs (the checkpoint was written by a trainer without "
                          "humanline, or by fewer processes), so the run would resume against the initial reference "
                          "and sync on other updates", "resume from a checkpoint this humanline trainer wrote, with "
                          "the same number of processes, or start a fresh run")
        payload = {"sync": None, "transform": None}
    else:
        payload = _load_rank_file(checkpoint, sync_path)
    if payload["sync"] is not None or syncing:
        if not syncing:
            raise _refuse(checkpoint, f"`{sync_path.name}` holds a sync state and this trainer keeps its reference "
                          "frozen (`schedule=None`)", "resume with the schedule that wrote the checkpoint")
        _check_sync(checkpoint, sync_path.name, payload["sync"], trainer.humanline_sync.expected_shards(), schedule,
                    step)
    _check_transform(checkpoint, sync_path.name, payload["transform"], transform)
    rows = None
    state_path = checkpoint / STATE_FILE
    if state_path.is_file():
        rows = json.loads(state_path.read_text())
        _check_rows(checkpoint, rows, trainer.humanline_settings_record())
    return Resume(payload["sync"], payload["transform"], rows)


# --------------------------------------------------------------------------------------- DeepSpeed's own loads
_ENGINE_REFUSAL = refusal(
    HumanlineTrlSettingError,
    "resume from a checkpoint this trainer wrote (an earlier `checkpoint-N`), or start a fresh run.",
    "DeepSpeed's file is damaged or cut short. Fix: resume from an earlier `checkpoint-N`, or copy this one again.")


def install_safe_engine(engine) -> None:
    """Give the DeepSpeed ``engine`` a checkpoint engine whose loads are weights-only (the pack's,
    ``hl_core.storage.deepspeed_checkpoints``, with DeepSpeed's allowlist), refusing anything else in one paragraph
    (``HumanlineTrlSettingError``)."""
    engine.checkpoint_engine = safe_checkpoint_engine(engine._config, refusal=_ENGINE_REFUSAL)


def expected_local(param, zero3_pending: bool) -> Optional[torch.Tensor]:
    """This rank's shard of ``param`` as the sync saves it, or None where the layout is not final yet (a policy
    parameter that ZeRO-3 partitions only when training starts: ``ReferenceSync.load_state_dict`` checks it then)."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    if zero3_pending:
        return None
    data = param.data
    return data.to_local() if hasattr(data, "to_local") else data
