"""Entry point: ``python|torchrun|deepspeed launchers/run.py RECIPE [key=value ...] [--validate]``.

Examples::

    python launchers/run.py recipes/tiny/humanline_dpo.yaml
    deepspeed --num_gpus 2 launchers/run.py recipes/tiny/humanline_dpo.yaml engine.zero_stage=3
    python launchers/run.py recipes/tiny/humanline_dpo.yaml --validate
    python launchers/run.py recipes/llama3_8b_humanline_dpo.yaml --plan

Exit codes: 0 finished (or stopped by a STOP file / ``train.stop_after``), 1 failure, 2 bad input (one
paragraph, no traceback), 3 stopped on a non-finite update, 4 stopped by SIGTERM/SIGINT after saving a
resumable checkpoint (a second signal: 143 / 130 at once; a signal during the post-training evaluations:
143 / 130 once they stopped), 5 the disk filled while writing (one paragraph: the file, the last complete
checkpoint, free space and rerun). See ``hl_core/loop/guard.py``.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from pathlib import Path
from typing import Dict

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hl_core.errors import EXIT_DISK_FULL, EXIT_USER_ERROR, LaunchError, UserError  # noqa: E402
from hl_core.loop.guard import NonFiniteStop  # noqa: E402


def micro_batches_arg(text: str):
    """``--rehearse-micro-batches``: a whole number, or ``all`` (the recipe's own count)."""
    if text.strip().lower() == "all":
        return "all"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a whole number nor `all`") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="run.py", description="Train one humanline recipe (DPO/KTO/GRPO on DeepSpeed).",
        epilog="Overrides use dotted keys, e.g. `engine.zero_stage=3 train.lr=5e-7 humanline.sync_every=null`.",
    )
    parser.add_argument("recipe", help="recipe YAML file, e.g. recipes/tiny/humanline_dpo.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted `key=value` overrides (values parsed as YAML)")
    parser.add_argument("--validate", action="store_true", help="check the recipe (and local data) without training")
    parser.add_argument("--plan", action="store_true",
                        help="print the world layout and a per-GPU memory estimate (no GPU, no downloads)")
    parser.add_argument("--print-config", action="store_true", help="print the fully resolved recipe and exit")
    parser.add_argument("--rehearse", action="store_true",
                        help="run rank 0 (and the last pipeline stage's first rank) of the recipe's world size in one "
                             "process with a fake process group; print measured memory, compute and traffic beside "
                             "--plan")
    parser.add_argument("--rehearse-rank", type=int, default=None,
                        help="with --rehearse: only this rank, in this process")
    parser.add_argument("--rehearse-kernels", choices=("auto", "real", "shapes"), default="auto",
                        help="with --rehearse: real kernels, or shape-only matrix products (auto: shapes on a CPU)")
    parser.add_argument("--rehearse-micro-batches", type=micro_batches_arg, default=None,
                        help="with --rehearse: at most this many micro-batches per update (time and traffic scaled), "
                             "or `all`; default: 4 on a CPU (at least the pipeline's stages), all on a GPU")
    parser.add_argument("--rehearse-json", default=None, help="with --rehearse: also write the results here (JSON)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def validate(recipe, world_size=None) -> str:
    """Everything checkable without weights or a GPU: the recipe's own checks (``hl_core.config.validation``), then
    ``hl_core/preflight/validate.py``."""
    from hl_core.config import validation
    from hl_core.preflight.validate import validate_run

    return validate_run(validation(recipe, world_size))


def check_post_training_evals(recipe) -> None:
    """What the post-training evals the recipe enables need from this environment, checked before any training: their
    packages, and MATH-500's pinned LaTeX parser runtime (another one would change the verdicts, and would otherwise
    only be refused after training, when the scorer starts). A ``UserError`` naming the fix."""
    if not (recipe.eval.after_training and recipe.eval.math500.enabled):
        return
    from hl_core.config.checks import check_sink_packages

    check_sink_packages(recipe)
    from eval.math500 import check_scorer_runtime  # eval/ only where MATH-500 runs after training

    check_scorer_runtime()


def post_training_eval(recipe, model_dir: Path) -> Dict[str, str]:
    """The enabled ``eval.math500`` / ``eval.alpaca_eval`` / ``eval.data_quality`` blocks on ``final/``
    (rank 0, after training, engines torn down); results in ``output_dir/eval/*.json``. A failing block
    is reported, not raised: training succeeded."""
    from hl_core.config import POST_TRAINING_EVALS

    enabled = [b for b in POST_TRAINING_EVALS if getattr(recipe.eval, b).enabled]
    if not enabled:
        return {}
    from eval.run_from_recipe import run_post_training_eval

    if recipe.model.lora_enabled:
        model_dir = Path(model_dir) / "merged"  # `final/` holds the adapter; the merged model is beside it
    print(f"post-training evals: {', '.join(enabled)} on {model_dir}", flush=True)
    results = run_post_training_eval(recipe, model_dir=model_dir, output_dir=recipe.output_dir, raise_on_error=False)
    failed = [b for b in enabled if isinstance(results.get(b), dict) and "error" in results[b]]
    for block in failed:
        print(f"post-training eval `{block}` failed: {results[block]['error']}", flush=True)
    print(f"post-training eval results in {results.get('eval_dir')}", flush=True)
    return {b: ("failed" if b in failed else "ok") for b in enabled}


def main(argv=None) -> int:
    started = time.time()  # a STOP file older than this is stale (hl_core/loop/lifecycle.py)
    args = build_parser().parse_intermixed_args(argv)  # overrides may come before or after flags
    rank = os.environ.get("RANK", "0").strip()
    rank = int(rank) if rank.isdigit() else 0  # only says who prints; the trainer refuses a malformed RANK
    recipe = None
    try:
        from hl_core.config import load_recipe, recipe_to_yaml

        recipe = load_recipe(args.recipe, args.overrides)
        if args.print_config:
            print(recipe_to_yaml(recipe), end="")
            return 0
        from hl_core.config.checks import env_world_size

        world = env_world_size()
        if args.plan:  # exit 1 when the estimate exceeds `cluster.gpu_memory_gb`, so scripts can gate on it
            from hl_core.config import run_shape
            from hl_core.preflight.plan import memory_plan, plan_report

            shape = run_shape(recipe)  # what a plan reads
            print(plan_report(shape, world))
            return 1 if memory_plan(shape, world)["exceeds"] else 0
        if args.validate:
            report = validate(recipe, world)
            check_post_training_evals(recipe)
            print(report)
            return 0
        if args.rehearse or args.rehearse_rank is not None:
            # deepspeed/megatron and the trainer: only a rehearsal needs them here
            from hl_core.rehearsal import rehearse

            return rehearse(args.recipe, args.overrides, args.rehearse_rank, args.rehearse_kernels,
                            args.rehearse_micro_batches, args.rehearse_json)
        from hl_core.loop.lifecycle import note_run_start
        from hl_core.trainer import run

        check_post_training_evals(recipe)
        note_run_start(started)
        return run(recipe, after_training=post_training_eval).get("exit_code", 0)
    except UserError as exc:
        if rank == 0 or isinstance(exc, LaunchError):  # a bad RANK: no process knows that it is rank 0
            print(f"error: {exc}", file=sys.stderr, flush=True)
        elif exc.rank_local:  # about this rank's own file: rank 0 may not have met it
            print(f"error (rank {rank}): {exc}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except NonFiniteStop as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 (a full disk is reported; anything else is re-raised as it was)
        from hl_core.storage.disk_full import disk_full_message, is_disk_full  # imported here: only on a failure

        if recipe is None or not is_disk_full(exc, recipe.output_dir):
            raise
        print(f"error: {disk_full_message(recipe.output_dir, exc)}", file=sys.stderr,
              flush=True)  # every rank: its own disk
        return EXIT_DISK_FULL


def exit_after_teardown(code: int) -> None:
    """End a multi-rank run with ``os._exit`` once ``main`` has returned.

    By then the sinks and checkpoints are closed and the process group is destroyed. Skipping interpreter
    finalization avoids a rare SIGABRT on a finished rank ("terminate called without an active exception"),
    raised while C++ collective threads and Python objects are torn down in an arbitrary order. torchrun would
    count that abort as a failed job. Single-process runs exit normally.
    """
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if world.isdigit() and int(world) > 1:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    faulthandler.enable()  # a rank killed by a fatal signal still prints where its Python code was
    exit_after_teardown(main())
