"""``--rehearse`` of the production recipes at their real widths, world sizes and batch shapes, 1-2 layers per
pipeline stage on the CPU (full depth on a GPU: ``--layers 0``), one after the other (each rank in a process of
its own), and the table of every memory term measured beside ``--plan`` for the same rank.

    python bench/rehearse.py [--layers 2] [--only NAME ...] [--out docs/perf/rehearse_cpu_<date>.md]

Writes the Markdown table (and the raw results beside it, ``.json``); ``--include`` tables the results of earlier
invocations first, so rows run with different ``--set`` overrides land in one file. Memory per rehearsal on the
CPU: the ZeRO-3 Gemma-2-27B rank at 2 layers peaks near 13 GiB (its 256k-vocabulary embedding and logits), the
Qwen GRPO rank at micro-batch 1 near 15 GiB: run nothing else big beside them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hl_core import children  # noqa: E402 (each rehearsal ends with this script)
from hl_core.rehearsal.report import GIB, memory_rows, projected_seconds  # noqa: E402 (after the path insert)

RECIPES = {  # the acceptance set: recipe, layers per pipeline stage x pp
    "llama3_8b_humanline_dpo": "recipes/llama3_8b_humanline_dpo.yaml",
    "gemma2_27b_humanline_dpo": "recipes/gemma2_27b_humanline_dpo.yaml",
    "gemma2_27b_humanline_dpo_zero3": "recipes/gemma2_27b_humanline_dpo_zero3.yaml",
    "qwen2.5_1.5b_humanline_sparse64_grpo_math": "recipes/qwen2.5_1.5b_humanline_sparse64_grpo_math.yaml",
}


def rehearse(recipe: str, layers: int, micro_batches: int, extra: list) -> list:
    with tempfile.TemporaryDirectory(prefix="bench_rehearse_") as scratch:
        out = Path(scratch) / "results.json"
        command = [sys.executable, str(REPO / "launchers" / "run.py"), recipe, "--rehearse",
                   "--rehearse-micro-batches", str(micro_batches), "--rehearse-json", str(out), *extra]
        if layers:
            pp = _pp(recipe)
            command.append(f"model.config_overrides={{num_hidden_layers: {layers * pp}}}")
        proc = children.run(command, cwd=REPO)
        if proc.returncode != 0:
            raise SystemExit(f"{recipe}: exit {proc.returncode}")
        results = json.loads(out.read_text())
        skipped = [r["rank"] for r in results if r["skipped_updates"]]
        if skipped:  # a skipped step leaves the optimizer's memory (and, in the warm-up, its states) out
            raise SystemExit(f"{recipe}: rank(s) {skipped} skipped an update (a non-finite loss or statistic): "
                             "its memory terms are not a real update's; nothing tabled. Re-run it.")
        return results


def _pp(recipe: str) -> int:
    # the recipe's own loader (hl_core.config): the bench imports anything
    from hl_core.config import load_recipe

    loaded = load_recipe(REPO / recipe)
    return loaded.parallel.pp if loaded.engine.name == "megatron" else 1


def replan(result: dict) -> dict:
    """The plan for the rehearsed rank from today's ``--plan`` (a result keeps the plan of the code that ran it)."""
    # the recipe's own loader and planner: the bench imports anything
    from hl_core.config import load_recipe, run_shape
    from hl_core.preflight.plan import memory_plan

    layers = f"model.config_overrides={{num_hidden_layers: {result['layers']}}}"
    shape = run_shape(load_recipe(REPO / RECIPES[result["recipe"]], [layers, *result.get("extra", [])]))
    cpu_megatron = result["engine"] == "megatron" and result["device"] == "CPU"
    plan = memory_plan(shape, result["world_size"], stage=result["coords"]["pp_stage"], dp_rank=result["coords"]["dp"],
                       distributed_optimizer=not cpu_megatron, megatron_gpu=not cpu_megatron)
    return dict(result, plan=plan)


def table(results: list) -> str:
    lines = []
    for result in map(replan, results):
        c = result["coords"]
        engine = f"ZeRO-{result['zero_stage']}" if result["engine"] == "deepspeed" else \
            f"megatron tp {result['plan']['tp']} x pp {result['plan']['pp']}"
        lines += [f"### {result['recipe']}: rank {result['rank']} of {result['world_size']} ({engine}, pipeline stage "
                  f"{c['pp_stage']}), {result['model']} at {result['layers']} layers, {result['device']}, "
                  f"{result['kernels']} kernels"
                  + (f"; overrides {' '.join(result['extra'])}" if result.get("extra") else ""),
                  "",
                  "| term | measured GiB | plan GiB | measured / plan | how measured |", "|---|---:|---:|---:|---|"]
        for label, measured, planned, how in memory_rows(result):
            ratio = f"{measured / planned:.2f}" if planned and max(measured, planned) >= 64 * 1024 ** 2 else "-"
            lines.append(f"| {label.strip()} | {measured / GIB:.3f} | {planned / GIB:.3f} | {ratio} | {how} |")
        lines += ["", "| collective | calls / update | payload GiB / update | link | modelled s |",
                  "|---|---:|---:|---|---:|"]
        for kind, row in sorted(result["traffic"].items()):
            link = "InfiniBand" if row["between_nodes"] else "NVLink"
            lines.append(f"| {kind} | {row['calls']:.0f} | {row['payload'] / GIB:.3f} | {link} | "
                         f"{row['seconds']:.3f} |")
        times = projected_seconds(result)
        lines += ["", f"humanline sync: {result['sync_bytes'] / GIB:.3f} GiB through collectives (reference log-probs: "
                  f"{result['reference_mode']}); communication per update at the stated bandwidths (a model): "
                  f"{times['communication_s']:.2f} s; notes: {'; '.join(result['notes'])}"
                  + (f"; {len(result['zeroed_gradients'])} gradient tensor(s) held NaN or inf and were zeroed so the "
                     "step ran" if result.get("zeroed_gradients") else ""), ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2, help="layers per pipeline stage (0: the recipe's depth)")
    parser.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rehearsed update")
    parser.add_argument("--only", nargs="*", choices=sorted(RECIPES), default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--set", nargs="*", default=[], help="extra key=value overrides (say why in the table)")
    parser.add_argument("--include", nargs="*", default=[], help="results (.json) of earlier rehearsals to table first")
    args = parser.parse_args()
    results = [r for path in args.include for r in json.loads(Path(path).read_text())]
    for name in RECIPES if args.only is None else args.only:
        results += [dict(r, extra=args.set) for r in rehearse(RECIPES[name], args.layers, args.micro_batches, args.set)]
    out = Path(args.out or REPO / "docs" / "perf" / f"rehearse_cpu_{datetime.date.today()}.md")
    header = (f"# `--rehearse` beside `--plan` ({args.layers or 'all'} layers per stage, {args.micro_batches} "
              f"micro-batches per update; `python bench/rehearse.py`)\n\n")
    out.write_text(header + table(results))
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=float))
    print(out.read_text())


if __name__ == "__main__":
    main()
