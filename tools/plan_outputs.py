"""Write every recipe's ``--plan`` output under four layouts, and compare two such folders.

A restructure must not change what ``--plan`` says. Run this on a checkout from before the change and on one from
after it, then compare:

    python3 tools/plan_outputs.py write /tmp/plans-before      # in the checkout before the change
    python3 tools/plan_outputs.py write /tmp/plans-after       # in the checkout after it
    python3 tools/plan_outputs.py compare /tmp/plans-before /tmp/plans-after

``write`` runs ``launchers/run.py RECIPE --plan`` in this process for every recipe under ``recipes/`` (not the
``_``-prefixed defaults or ``_base/``) under each layout of ``LAYOUTS``, and writes ``DIR/<recipe>@<layout>.txt``
(what it printed on stdout and stderr, and its exit code) and ``DIR/<recipe>@<layout>.json`` (``memory_plan``'s
dict, or the error it raised). The reproduction studies' recipes start from files a fresh checkout lacks: they are
planned on the toy task's model and sample data, as ``tests/test_plan.py`` plans them. ``compare`` exits 0 when both
folders hold the same files with the same bytes, 1 otherwise, naming each difference.
"""

import argparse
import contextlib
import io
import json
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
# each layout: the overrides it adds to the recipe
LAYOUTS = {
    "as_written": [],
    "zero3": ["engine.zero_stage=3"],
    "megatron_tp2_pp2": ["engine.name=megatron", "engine.zero_stage=0", "parallel.tp=2", "parallel.pp=2"],
    "two_nodes": ["cluster.nodes=2"],
}


def recipes() -> list:
    """Every runnable recipe, as ``tests/test_plan.py`` lists them."""
    root = REPO / "recipes"
    return sorted(p for p in root.rglob("*.yaml") if not p.name.startswith("_") and "_base" not in p.parts)


def start_overrides(path: pathlib.Path) -> list:
    """The studies' arms start from the warm-up run's ``final/`` and (offline preference arms) from data their
    weaker model writes: the toy task's model and sample rows stand in (``tests/helpers.start_model_overrides``)."""
    overrides = []
    if "repro" in path.parts and path.name != "warmup.yaml":
        overrides.append("model.name_or_path=tests/fixtures/toy_add/model")
    if "preference" in path.parts and "_offline" in path.name:
        kind = "groups" if path.name.startswith("grpo") else "pairs"
        overrides.append(f"data.train.path=tests/fixtures/toy_add/pref_{kind}_sample.jsonl")
    return overrides


def _plan_dict(path: pathlib.Path, overrides: list) -> dict:
    from hl_core.config import load_recipe
    from hl_core.preflight.plan import memory_plan

    try:
        return memory_plan(load_recipe(path, overrides))
    except Exception as exc:  # the refusal is the output
        return {"error": type(exc).__name__, "message": str(exc)}


def write_one(directory: pathlib.Path, path: pathlib.Path, layout: str) -> None:
    """``path``'s ``--plan`` output under ``layout`` (a key of ``LAYOUTS``): ``<name>@<layout>.txt`` and ``.json``."""
    from launchers import run

    name = str(path.relative_to(REPO / "recipes").with_suffix("")).replace("/", "__")
    overrides = start_overrides(path) + LAYOUTS[layout]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run.main([str(path), "--plan", *overrides])
    text = f"exit {code}\n--- stdout\n{out.getvalue()}--- stderr\n{err.getvalue()}"
    (directory / f"{name}@{layout}.txt").write_text(text)
    plan = json.dumps(_plan_dict(path, overrides), indent=1, sort_keys=True, default=str)
    (directory / f"{name}@{layout}.json").write_text(plan + "\n")


def write_all(directory: pathlib.Path) -> int:
    """Write each recipe x layout's output; returns how many pairs were written."""
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.pop("WORLD_SIZE", None)
    pairs = [(path, layout) for path in recipes() for layout in LAYOUTS]
    for path, layout in pairs:
        write_one(directory, path, layout)
    print(f"{len(pairs)} recipe x layout pairs ({2 * len(pairs)} files) in {directory}")
    return len(pairs)


def compare(before: pathlib.Path, after: pathlib.Path) -> int:
    """Print each difference; returns how many files differ (or are on one side only)."""
    names = sorted({p.name for p in before.iterdir()} | {p.name for p in after.iterdir()})
    bad = 0
    for name in names:
        a, b = before / name, after / name
        if not (a.exists() and b.exists()):
            print(f"{name}: only in {before if a.exists() else after}")
            bad += 1
        elif a.read_bytes() != b.read_bytes():
            print(f"{name}: differs")
            bad += 1
    print(f"{len(names)} files, {bad} differ")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("write").add_argument("directory", type=pathlib.Path)
    both = sub.add_parser("compare")
    both.add_argument("before", type=pathlib.Path)
    both.add_argument("after", type=pathlib.Path)
    args = parser.parse_args(argv)
    for key in ("directory", "before", "after"):
        if getattr(args, key, None) is not None:
            setattr(args, key, getattr(args, key).resolve())
    os.chdir(REPO)  # the recipes' relative paths (data, the toy model) are the repository's
    sys.path.insert(0, str(REPO))
    if args.command == "write":
        write_all(args.directory)
        return 0
    return 1 if compare(args.before, args.after) else 0


if __name__ == "__main__":
    sys.exit(main())
