"""Checks of ``checkpoint.resume`` that need no weights: the path is a checkpoint, and the checkpoint was
written by the same engine, ZeRO stage family and data-parallel size as this run (read from its file names,
never by unpickling anything).

What the engines write in ``<output_dir>/checkpoints/step_N/`` (DeepSpeed 0.19, ``hl_core/engines``):

* DeepSpeed ZeRO-0: ``mp_rank_00_model_states.pt`` (rank 0 holds the whole state);
* ZeRO-1/2: the same plus ``zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` for each data-parallel rank ``r``
  (stages 1 and 2 load each other's checkpoints; another data-parallel size does not load);
* ZeRO-3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` and ``..._optim_states.pt`` for each rank;
* Megatron: ``megatron_layout.json`` (tp, pp, world size) and ``mp_rank_pp{p}_tp{t}.pt`` shards.

A checkpoint counts only with its ``complete.json`` (``hl_core/storage/checkpoints.py``); ``latest`` is not read. A
checkpoint may also be named directly (``.../step_N``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

from ..errors import RecipeError
from ..storage.checkpoints import (
    COMPLETE_MARKER,
    is_complete,
    newest_complete,
    read_marker,
    read_megatron_layout,
    step_dirs,
)

MEGATRON_LAYOUT_FILE = "megatron_layout.json"  # hl_core.engines.megatron_checkpoint.LAYOUT_FILE
_ZERO_OPTIM = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")
_ZERO_MODEL = re.compile(r"zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt")
_DS_MODEL = re.compile(r"mp_rank_\d+_model_states\.pt")
_MEGATRON_SHARD = re.compile(r"mp_rank_pp\d+_tp\d+\.pt")
FRESH = "start afresh with `checkpoint.resume=never` (or another `output_dir`)"


def _files(path: Path) -> List[str]:
    return [p.name for p in path.iterdir() if p.is_file()]


def is_checkpoint(path: Path) -> bool:
    """``path`` holds the files of one checkpoint (DeepSpeed or Megatron)."""
    names = _files(path)
    return any(_DS_MODEL.fullmatch(n) or _ZERO_MODEL.fullmatch(n) or _MEGATRON_SHARD.fullmatch(n)
               or n == MEGATRON_LAYOUT_FILE for n in names)


def check_resume(recipe, world_size: int) -> None:
    """``checkpoint.resume`` names a usable, complete checkpoint for ``world_size`` processes (``auto``: the newest
    complete one in ``<output_dir>/checkpoints``, if any). Raises ``RecipeError`` naming the key and the fix."""
    resume = recipe.checkpoint.resume
    if resume == "never":
        return
    if resume == "auto":
        directory = Path(recipe.output_dir) / "checkpoints"
        target, _ = newest_complete(directory)
        if target is None:
            return  # nothing (complete) saved yet: a fresh start; the trainer says which it ignored
        where = f"`checkpoint.resume: auto` found `{target}` (the newest complete checkpoint in `{directory}`)"
    else:
        path = Path(resume)
        if not path.is_dir():
            raise RecipeError(
                f"`checkpoint.resume: {resume}` is a file, not a checkpoint directory. Fix: point it at "
                "`<output_dir>/checkpoints` or a `step_N` directory in it, or use `auto` / `never`."
            )
        named = is_checkpoint(path) or is_complete(path)
        target = path if named else newest_complete(path)[0]
        if target is None and step_dirs(path):
            raise RecipeError(
                f"`checkpoint.resume: {resume}` holds no complete checkpoint: none of its `step_N/` directories has "
                f"`{COMPLETE_MARKER}` (their saves were interrupted, or an older version wrote them). Fix: point it at "
                "a complete checkpoint, or use `never`."
            )
        if target is None:
            raise RecipeError(
                f"`checkpoint.resume: {resume}` is a directory but not a checkpoint: it has no `step_N/` checkpoints "
                "and no checkpoint files. Fix: point it at `<output_dir>/checkpoints` or a `step_N` directory in it, "
                "or use `auto` / `never`."
            )
        where = f"`checkpoint.resume: {resume}`"
        if not is_complete(target):
            raise RecipeError(
                f"{where}: `{target}` is incomplete (no `{COMPLETE_MARKER}`: its save was interrupted, or an older "
                "version wrote it), so it may hold a mix of files. Fix: point `checkpoint.resume` at a complete "
                "`step_N` directory (`auto` picks the newest), or use `never`; if an older version of this pack "
                f"wrote it whole, add an empty `{COMPLETE_MARKER}` to it."
            )
    if not is_checkpoint(target):
        raise RecipeError(
            f"{where}, but `{target}` holds no checkpoint files (missing or not a checkpoint of this pack). "
            "Fix: point `checkpoint.resume` at a complete `step_N` directory, or use `never`."
        )
    read_marker(target)  # a damaged complete.json is refused here (it says what the checkpoint holds)
    _check_layout(target, recipe, world_size, where)


def _check_layout(path: Path, recipe, world_size: int, where: str) -> None:
    names = _files(path)
    megatron = MEGATRON_LAYOUT_FILE in names
    engine = recipe.engine.name
    if megatron != (engine == "megatron"):
        saved = "megatron" if megatron else "deepspeed"
        raise RecipeError(
            f"{where}: that checkpoint was written by the {saved} engine, but this run has `engine.name: {engine}`. "
            f"Fix: set `engine.name={saved}`, or {FRESH}."
        )
    if megatron:
        layout = read_megatron_layout(path / MEGATRON_LAYOUT_FILE)
        tp, pp = recipe.parallel.tp, recipe.parallel.pp
        if (layout.get("tp"), layout.get("pp")) != (tp, pp):
            raise RecipeError(
                f"{where}: that checkpoint was written with `parallel.tp={layout.get('tp')}`, "
                f"`parallel.pp={layout.get('pp')}`; this run has tp={tp}, pp={pp}. Fix: resume with that layout, or "
                f"{FRESH}."
            )
        return
    ranks = sorted(int(m.group(1)) for n in names if (m := _ZERO_OPTIM.fullmatch(n)))
    saved_stage = "3" if any(_ZERO_MODEL.fullmatch(n) for n in names) else ("1 or 2" if ranks else "0")
    stage = recipe.engine.zero_stage
    if str(stage) not in saved_stage:
        raise RecipeError(
            f"{where}: that checkpoint was saved with ZeRO stage {saved_stage}, but this run has "
            f"`engine.zero_stage: {stage}`, and DeepSpeed cannot load one into the other. "
            f"Fix: set `engine.zero_stage={saved_stage[0]}`, or {FRESH}."
        )
    dp = world_size // (recipe.parallel.tp * recipe.parallel.pp)
    if ranks and len(ranks) != dp:
        raise RecipeError(
            f"{where}: that checkpoint holds the ZeRO-{saved_stage} optimizer states of {len(ranks)} data-parallel "
            f"rank(s), but this run has {dp} (world size {world_size}); DeepSpeed cannot repartition them. Fix: "
            f"resume with {len(ranks) * recipe.parallel.tp * recipe.parallel.pp} process(es), or {FRESH}."
        )
