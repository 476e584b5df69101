"""Post-training evals driven by a recipe's ``eval:`` block.

The launcher (``launchers/run.py``, through ``hl_core.trainer.run``'s ``after_training`` callback) calls,
on rank 0 after training (engines torn down)::

    from eval.run_from_recipe import run_post_training_eval
    run_post_training_eval(recipe, model_dir=f"{recipe.output_dir}/final", output_dir=recipe.output_dir)

and ``python -m eval RECIPE.yaml`` does the same from the command line. Results land in
``output_dir/<eval.output_subdir>/`` (default ``output_dir/eval/``): ``math500.json``, ``alpaca_eval.json``,
``data_quality.json`` (+ their per-sample files).

Recipe keys (all under ``eval:``, next to the held-out keys ``every``/``at_start``/...; see
`EVAL_KEYS` for the types, defaults and descriptions)::

    eval:
      after_training: true      # run the enabled blocks below when training finishes
      output_subdir: eval
      offline: false            # never touch the Hugging Face hub during these evals
      math500:      {enabled: false, data: null, n_samples: 1, temperature: 0.6, top_p: 0.95, max_new_tokens: 2048, ...}
      alpaca_eval:  {enabled: false, data: null, judge: "api:weighted_alpaca_eval_gpt-4.1", ...}
      data_quality: {enabled: false, data: null, ...}   # data null = the recipe's data.train
"""

from __future__ import annotations

import copy
import logging
import traceback
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Union

from hl_core.errors import UserError

from ._common import EvalError, set_offline

log = logging.getLogger(__name__)

def _keys_from_schema() -> Dict[str, Any]:
    """name -> (type, default, description), blocks as nested dicts: read off the recipe schema
    (``hl_core.config.EvalConfig``), the single source of these keys."""
    from hl_core.config import POST_TRAINING_EVALS, EvalConfig
    from hl_core.config.keys_doc import _type_name

    def entries(model, names=None):
        out: Dict[str, Any] = {}
        for name, field in model.model_fields.items():
            if names is not None and name not in names:
                continue
            default = field.default_factory() if field.default_factory is not None else field.default
            out[name] = (_type_name(field.annotation), default, field.description or "")
        return out

    keys = entries(EvalConfig, ("after_training", "output_subdir", "offline"))
    for block in POST_TRAINING_EVALS:
        keys[block] = entries(EvalConfig.model_fields[block].annotation)
    return keys


EVAL_KEYS: Dict[str, Any] = _keys_from_schema()

BLOCKS = ("math500", "alpaca_eval", "data_quality")


def defaults() -> Dict[str, Any]:
    def strip(d):
        return {k: strip(v) if isinstance(v, dict) else v[1] for k, v in d.items()}

    return strip(EVAL_KEYS)


def keys_markdown() -> str:
    """The keys above as a markdown table (for the recipe reference)."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                lines.append(f"| `{prefix}{k}` | {v[0]} | `{v[1]!r}` | {v[2]} |")

    walk(EVAL_KEYS, "eval.")
    return "\n".join(lines)


def _as_dict(recipe: Any) -> Dict[str, Any]:
    if isinstance(recipe, dict):
        return copy.deepcopy(recipe)
    dump = getattr(recipe, "model_dump", None)
    if callable(dump):
        return dump()
    raise TypeError(f"recipe must be a Recipe or a dict, got {type(recipe).__name__}")


def eval_settings(recipe: Any) -> Dict[str, Any]:
    """The recipe's ``eval:`` post-training settings merged over the defaults (unknown keys are kept)."""
    merged = defaults()
    given = (_as_dict(recipe).get("eval") or {})
    for k, v in given.items():
        if k in BLOCKS and isinstance(v, dict):
            merged[k] = {**merged[k], **{kk: vv for kk, vv in v.items()}}
        elif k in merged and not isinstance(merged[k], dict):
            merged[k] = v
    return merged


def enabled_blocks(recipe: Any) -> list:
    s = eval_settings(recipe)
    return [b for b in BLOCKS if s[b].get("enabled")]


def _is_rank_zero() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception:
        return True


def _reference_model(recipe: Dict[str, Any], recipe_obj: Any):
    """The initial reference: ``model:`` of the recipe (random-init models rebuilt with ``train.seed``)."""
    import torch

    from hl_core.config import ModelConfig
    from hl_core.models.loading import build_causal_lm, load_tokenizer

    model_cfg = getattr(recipe_obj, "model", None)
    if model_cfg is None or isinstance(recipe_obj, dict):
        model_cfg = ModelConfig(**recipe["model"])
    precision = "fp32"
    if torch.cuda.is_available():
        precision = (recipe.get("engine") or {}).get("precision", "fp32")
    seed = int((recipe.get("train") or {}).get("seed", 42))
    model = build_causal_lm(model_cfg, precision, seed)
    tok = load_tokenizer(model_cfg)
    if torch.cuda.is_available():
        model = model.to("cuda")
    return model, tok, model_cfg.name_or_path + (" (random init, seed %d)" % seed if model_cfg.random_init else "")


def run_post_training_eval(
    recipe: Any,
    model_dir: Union[str, Path],
    output_dir: Union[str, Path],
    *,
    only: Optional[Iterable[str]] = None,
    raise_on_error: bool = True,
) -> Dict[str, Any]:
    """Run the recipe's enabled post-training evals; results in ``output_dir/<eval.output_subdir>/``.

    ``recipe``: the validated ``Recipe`` (or its dict); ``model_dir``: the trained model (``output_dir/final``);
    ``output_dir``: the run's output directory. ``only``: run these blocks whatever ``enabled`` says (the CLI
    uses it). Returns ``{"eval_dir": ..., "<block>": result dict or {"error": ...}}``; with
    ``raise_on_error`` an `EvalError` listing the failed blocks is raised after all blocks ran (its
    paragraph only, exit 2, when each failure was a user error; a ``RuntimeError`` when one was a bug, whose
    traceback was logged).
    Does nothing on ranks other than 0, or when ``eval.after_training`` is false and ``only`` is not given.
    """
    if not _is_rank_zero():
        return {"skipped": "not rank 0"}
    rdict = _as_dict(recipe)
    s = eval_settings(rdict)
    if only is not None:
        blocks = list(only)
    else:
        blocks = [b for b in BLOCKS if s[b].get("enabled")] if s["after_training"] else []
    eval_dir = Path(output_dir) / str(s.get("output_subdir") or "eval")
    return run_blocks(s, blocks, model_dir, eval_dir, recipe=recipe, raise_on_error=raise_on_error)


def run_blocks(
    settings: Dict[str, Any],
    blocks: Iterable[str],
    model_dir: Union[str, Path, None],
    eval_dir: Union[str, Path],
    *,
    recipe: Any = None,
    raise_on_error: bool = True,
) -> Dict[str, Any]:
    """Run ``blocks`` with ``settings`` (as `eval_settings` returns them) into ``eval_dir``."""
    blocks = list(blocks)
    for b in blocks:
        if b not in BLOCKS:
            raise EvalError(f"unknown eval block `{b}`; use one of {', '.join(BLOCKS)}.")
    eval_dir = Path(eval_dir)
    out: Dict[str, Any] = {"eval_dir": str(eval_dir)}
    if not blocks:
        return out
    set_offline(bool(settings.get("offline")))
    rdict = _as_dict(recipe) if recipe is not None else {}
    model_dir = str(model_dir) if model_dir is not None else None
    failures, bugs = [], 0
    for b in blocks:
        try:
            log.info("post-training eval: %s", b)
            out[b] = _run_block(b, settings[b], rdict, recipe, model_dir, eval_dir)
        except UserError as exc:  # a bad file or setting: its paragraph says it all
            out[b] = {"error": str(exc)}
            failures.append(f"{b}: {exc}")
        except Exception as exc:  # keep going: one failing eval must not lose the others
            msg = f"{type(exc).__name__}: {exc}"
            log.error("post-training eval %s failed: %s\n%s", b, msg, traceback.format_exc())
            out[b] = {"error": msg}
            failures.append(f"{b} ({msg})")
            bugs += 1
    if failures and raise_on_error:
        others = f" Results of the others are in {eval_dir}." if len(blocks) > 1 else ""
        text = f"eval failed: {'; '.join(failures)}{others}"
        raise RuntimeError(text) if bugs else EvalError(text)
    return out


def _need_model_dir(model_dir: Optional[str]) -> None:
    import os

    if not model_dir or not os.path.isdir(model_dir):
        raise EvalError(
            f"model directory `{model_dir}` does not exist. Fix: train with `checkpoint.save_final: true` (it writes "
            f"output_dir/final), or pass the model directory explicitly."
        )


def _run_block(name: str, cfg: Dict[str, Any], rdict: Dict[str, Any], recipe: Any, model_dir: str, eval_dir: Path):
    if name == "math500":
        from .math500 import run_math500

        _need_model_dir(model_dir)
        return run_math500(
            model_dir, data=cfg["data"], split=cfg["split"], n_samples=cfg["n_samples"],
            temperature=cfg["temperature"], top_p=cfg["top_p"], max_new_tokens=cfg["max_new_tokens"],
            prompt=cfg["prompt"], chat_template=cfg["chat_template"], backend=cfg["backend"],
            batch_size=cfg["batch_size"], limit=cfg["limit"], seed=cfg["seed"], dtype=cfg["dtype"],
            output_dir=eval_dir,
        )
    if name == "alpaca_eval":
        from .alpaca import run_alpaca_eval

        _need_model_dir(model_dir)
        return run_alpaca_eval(
            model_dir, data=cfg["data"], hub_config=cfg["hub_config"], reference_outputs=cfg["reference_outputs"],
            judge=cfg["judge"], rm_mode=cfg["rm_mode"], rm_batch_size=cfg["rm_batch_size"],
            trust_remote_code=cfg["trust_remote_code"], length_controlled=cfg["length_controlled"],
            lc_data=cfg["lc_data"], max_new_tokens=cfg["max_new_tokens"], temperature=cfg["temperature"],
            top_p=cfg["top_p"], chat_template=cfg["chat_template"], backend=cfg["backend"],
            batch_size=cfg["batch_size"], limit=cfg["limit"], seed=cfg["seed"], dtype=cfg["dtype"],
            generator_name=rdict.get("name") or None, output_dir=eval_dir,
        )
    from .data_quality import run_data_quality

    data_cfg = rdict.get("data") or {}
    train = data_cfg.get("train") or {}
    if isinstance(train, list) and not cfg.get("data"):
        raise EvalError("data_quality: `data.train` is a mixture of sources; name the data to score with "
                        "`eval.data_quality.data` (one source's path or name).")
    if cfg.get("data"):
        data, split, config, limit = cfg["data"], cfg.get("split", "train"), None, cfg.get("limit")
    else:
        data = train.get("path") or train.get("name")
        split, config = train.get("split", "train"), train.get("config")
        limit = cfg.get("limit") if cfg.get("limit") is not None else train.get("limit")
    if not data:
        raise EvalError("data_quality: no data (set `eval.data_quality.data` or `data.train`).")
    if cfg.get("model"):
        model, tok, label = cfg["model"], None, cfg["model"]
    elif rdict.get("model"):
        model, tok, label = _reference_model(rdict, recipe)
    else:
        raise EvalError("data_quality: no reference model (give one with --dq-model, or evaluate from a recipe).")
    return run_data_quality(
        data, model, tok, split=split, config=config, limit=limit, data_format=data_cfg.get("format", "auto"),
        max_length=int(_first(cfg.get("max_length"), data_cfg.get("max_length"), 1024)),
        max_prompt_length=int(_first(cfg.get("max_prompt_length"), data_cfg.get("max_prompt_length"), 512)),
        chat_template=_first(cfg.get("chat_template"), data_cfg.get("chat_template"), "auto"),
        batch_size=int(cfg.get("batch_size", 8)), model_label=label, output_dir=eval_dir,
        kind=cfg.get("kind", "auto"),
    )


def _first(*values):
    return next(v for v in values if v is not None)
