"""``python -m eval RECIPE_OR_MODEL_DIR [--math500 [SRC]] [--alpaca [SRC]] [--data-quality [SRC]] [--output DIR]``

* ``RECIPE.yaml``: evaluates the run's ``output_dir/final`` with the recipe's ``eval:`` settings; results in
  ``output_dir/eval/`` (``--output`` to change). Without a block flag, the recipe's enabled blocks run.
  ``--set a.b=c`` overrides recipe keys (e.g. ``--set eval.math500.n_samples=4``).
* ``MODEL_DIR``: evaluates that Hugging Face model directory; results in ``MODEL_DIR/eval/`` (or
  ``RUN/eval`` for ``RUN/final``). Name the blocks to run.

Blocks (an optional SRC overrides the data source: a local file or a HF dataset name):

* ``--math500 [SRC]``: MATH-500 pass@1 (lm-eval + math-verify); default data ``HuggingFaceH4/MATH-500``.
* ``--alpaca [SRC]``: AlpacaEval generation + judging; default data: hub ``tatsu-lab/alpaca_eval``.
* ``--data-quality [SRC]``: the data-quality proxy; default data: the recipe's ``data.train``.

``--offline`` forbids every Hugging Face hub access (local model and data only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

_DEFAULT = "__block_default__"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m eval", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
    )
    p.add_argument("target", help="a recipe YAML (evaluates output_dir/final) or a Hugging Face model directory")
    p.add_argument("--output", "-o", default=None,
                   help="results directory (default: output_dir/eval or MODEL_DIR/eval)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="recipe override, e.g. eval.math500.n_samples=4 (repeatable)")
    p.add_argument("--offline", action="store_true", default=None, help="never touch the Hugging Face hub")

    g = p.add_argument_group("shared generation settings (MATH500 and AlpacaEval)")
    g.add_argument("--backend", choices=("auto", "hf", "vllm"), default=None)
    g.add_argument("--batch-size", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    g.add_argument("--no-chat-template", dest="chat_template", action="store_false", default=None)

    m = p.add_argument_group("MATH500")
    m.add_argument("--math500", nargs="?", const=_DEFAULT, default=None, metavar="SRC",
                   help="run MATH500 (SRC: local JSONL in the MATH-500 schema, or a HF dataset name)")
    m.add_argument("--samples", type=int, default=None, help="samples per problem (default 1)")
    m.add_argument("--temperature", type=float, default=None, help="default 0.6")
    m.add_argument("--top-p", type=float, default=None, help="default 0.95")
    m.add_argument("--max-new-tokens", type=int, default=None, help="default 2048")
    m.add_argument("--prompt", choices=("r1", "boxed", "minerva"), default=None, help="default r1")
    m.add_argument("--limit", type=int, default=None, help="first N problems only")

    a = p.add_argument_group("AlpacaEval")
    a.add_argument("--alpaca", nargs="?", const=_DEFAULT, default=None, metavar="SRC",
                   help="run AlpacaEval (SRC: local JSON/JSONL with instruction + reference output)")
    a.add_argument("--judge", default=None,
                   help="api:NAME | rm:MODEL | py:MODULE:FUNCTION (default api:weighted_alpaca_eval_gpt-4.1)")
    a.add_argument("--reference-outputs", default=None, help="file of reference outputs (by instruction)")
    a.add_argument("--hub-config", default=None, help="hub file of instructions (default alpaca_eval_gpt4_baseline)")
    a.add_argument("--lc-data", default=None, help="local copy of alpaca_eval's df_gamed.csv (length control)")
    a.add_argument("--no-length-control", dest="length_controlled", action="store_const", const="off", default=None)
    a.add_argument("--rm-mode", choices=("hard", "soft"), default=None)
    a.add_argument("--trust-remote-code", action="store_true", default=None, help="for reward models such as ArmoRM")
    a.add_argument("--alpaca-max-new-tokens", type=int, default=None, help="default 2048")
    a.add_argument("--alpaca-temperature", type=float, default=None, help="default 0.7")
    a.add_argument("--alpaca-top-p", type=float, default=None, help="default 0.95")
    a.add_argument("--alpaca-limit", type=int, default=None, help="first N instructions only")

    d = p.add_argument_group("data-quality proxy")
    d.add_argument("--data-quality", nargs="?", const=_DEFAULT, default=None, metavar="SRC",
                   help="score SRC (default: the recipe's data.train) under the reference model")
    d.add_argument("--dq-model", default=None, help="reference model directory (default: the recipe's model; "
                                                    "for a MODEL_DIR target: that model)")
    d.add_argument("--dq-kind", choices=("auto", "preference", "unpaired", "groups"), default=None)
    d.add_argument("--dq-split", default=None)
    d.add_argument("--dq-limit", type=int, default=None)
    d.add_argument("--dq-batch-size", type=int, default=None)
    d.add_argument("--dq-max-length", type=int, default=None)
    d.add_argument("--dq-max-prompt-length", type=int, default=None)
    return p


# block -> (CLI attribute, settings key) pairs: a flag given on the command line overrides the recipe's value
_SHARED_GENERATION_FLAGS = [(name, name) for name in ("backend", "batch_size", "seed", "dtype", "chat_template")]
CLI_KEYS = {
    "math500": _SHARED_GENERATION_FLAGS + [
        ("samples", "n_samples"), ("temperature", "temperature"), ("top_p", "top_p"),
        ("max_new_tokens", "max_new_tokens"), ("prompt", "prompt"), ("limit", "limit"),
    ],
    "alpaca_eval": _SHARED_GENERATION_FLAGS + [
        ("judge", "judge"), ("reference_outputs", "reference_outputs"), ("hub_config", "hub_config"),
        ("lc_data", "lc_data"), ("length_controlled", "length_controlled"), ("rm_mode", "rm_mode"),
        ("trust_remote_code", "trust_remote_code"), ("alpaca_max_new_tokens", "max_new_tokens"),
        ("alpaca_temperature", "temperature"), ("alpaca_top_p", "top_p"), ("alpaca_limit", "limit"),
    ],
    "data_quality": [
        ("dq_model", "model"), ("dq_kind", "kind"), ("dq_split", "split"), ("dq_limit", "limit"),
        ("dq_batch_size", "batch_size"), ("dq_max_length", "max_length"), ("dq_max_prompt_length", "max_prompt_length"),
    ],
}
# block -> the CLI attribute that names it (and optionally its data source)
CLI_BLOCK_FLAGS = {"math500": "math500", "alpaca_eval": "alpaca", "data_quality": "data_quality"}


def apply_cli(settings: Dict[str, Any], a: argparse.Namespace) -> List[str]:
    """Fold the CLI flags into ``settings``; returns the blocks named on the command line."""
    if a.offline is not None:
        settings["offline"] = a.offline
    blocks = []
    for block, flag in CLI_BLOCK_FLAGS.items():
        source = getattr(a, flag)
        if source is not None:
            blocks.append(block)
            if source != _DEFAULT:
                settings[block]["data"] = source
        for attribute, key in CLI_KEYS[block]:
            value = getattr(a, attribute)
            if value is not None:
                settings[block][key] = value
    return blocks


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    if a.offline:  # before the hub libraries are imported
        from ._common import set_offline

        set_offline(True)
    from ._common import EvalError, default_eval_dir
    from .run_from_recipe import BLOCKS, eval_settings, run_blocks

    target = a.target
    is_recipe = os.path.isfile(target) and target.lower().endswith((".yaml", ".yml"))
    recipe = None
    if is_recipe:
        from hl_core.config import load_recipe

        recipe = load_recipe(target, a.overrides)
        settings = eval_settings(recipe)
        model_dir = str(Path(recipe.output_dir) / "final")
        subdir = str(settings.get("output_subdir") or "eval")
        eval_dir = Path(a.output) if a.output else Path(recipe.output_dir) / subdir
    else:
        if a.overrides:
            raise EvalError("--set overrides need a recipe target; pass the settings as flags for a model directory.")
        if not os.path.isdir(target):
            raise EvalError(
                f"`{target}` is neither a recipe (.yaml) nor a model directory. Fix: pass a recipe file or a Hugging "
                f"Face model directory (e.g. runs/NAME/final)."
            )
        settings = eval_settings({})
        model_dir = target
        eval_dir = Path(a.output) if a.output else default_eval_dir(target)
    blocks = apply_cli(settings, a)
    if not blocks and is_recipe:
        blocks = [b for b in BLOCKS if settings[b].get("enabled")]
    if not blocks:
        raise EvalError(
            "nothing to evaluate: name a block (--math500, --alpaca, --data-quality)"
            + (" or enable one under the recipe's `eval:` (e.g. eval.math500.enabled: true)." if is_recipe else ".")
        )
    if "data_quality" in blocks and not is_recipe:
        dq = settings["data_quality"]
        if not dq.get("data"):
            raise EvalError("--data-quality needs a data source (a file or HF name) when the target is a model "
                            "directory.")
        if not dq.get("model"):
            print("note: data quality uses the evaluated model as the reference; pass --dq-model with the initial "
                  "(reference) model to get the paper's proxy.", file=sys.stderr)
            dq["model"] = model_dir
    results = run_blocks(settings, blocks, model_dir, eval_dir, recipe=recipe)
    print(json.dumps({b: _headline(b, results.get(b) or {}) for b in blocks}, indent=1))
    print(f"results in {eval_dir}")
    return 0


def _headline(block: str, res: Dict[str, Any]) -> Dict[str, Any]:
    keys = {
        "math500": ("pass@1", "pass@1_std", "pass@n", "n_problems", "n_samples"),
        "alpaca_eval": ("win_rate", "length_controlled_winrate", "headline", "length_controlled_note", "n_total"),
        "data_quality": ("mean_logp", "quartiles", "in_paper_bad_quartile", "verdict"),
    }[block]
    return {k: res.get(k) for k in keys if k in res} or res


def single_block_main(flag: str, argv) -> int:
    """``python -m eval.<block> MODEL [--data FILE] [flags]`` == ``python -m eval MODEL <flag> [FILE] [flags]``."""
    argv = list(argv)
    data = None
    if "--data" in argv:
        i = argv.index("--data")
        data = argv[i + 1] if i + 1 < len(argv) else None
        del argv[i : i + 2]
    return main(argv[:1] + ([flag, data] if data else [flag]) + argv[1:])


if __name__ == "__main__":
    from hl_core.errors import exit_on_user_error

    exit_on_user_error(main)
