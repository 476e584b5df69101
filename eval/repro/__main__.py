"""Reproduction studies through our own pipeline: does humanline close the gap to online training?

    python -m eval.repro                           # GRPO study: 3 warm-ups (cached) x 9 arms x 2 seeds
    python -m eval.repro --study preference        # DPO / KTO / GRPO, offline vs online vs offline humanline
    python -m eval.repro --study preference_fair   # DPO / KTO with the paper's allowance: tuned lr and max
                                                   # grad norm, sync period, data source, clamp (< 60 min)
    python -m eval.repro --study preference_fair --plan  # its planned run count and ETA; runs nothing
    python -m eval.repro --study real --plan       # the real model (SmolLM2-135M): cells, offline sets, ETA
    python -m eval.repro --study real --arms offline_humanline --seeds 1   # one cell; finished cells are skipped
    python -m eval.repro [--study S] --quick       # a shortened grid with the sanity checks (< 3 min)
    python -m eval.repro [--study S] --sweep       # the regime sweep (chosen by the online arm(s) alone)
    python -m eval.repro --sweep --regimes lr1e-4 lr1e-4_T0.7   # some of its regimes

Every run is ``launchers/run.py``'s ``main()`` on a recipe from ``recipes/repro/`` (DeepSpeed on CPU, rollouts,
rewards) in a reused worker process (``eval/repro/worker.py``), 1 thread, deterministic algorithms, ``--jobs``
runs at a time. The warm-up model is a
random factor: ``--warmups`` supervised warm-ups (seeds 0, 1, ...) are crossed with ``--seeds`` RL seeds, and
intervals come from a hierarchical (warm-up, then seed) bootstrap. Writes ``results.json`` (curves,
statistics, wall-clock, sanity checks, versions, threads), ``results.md`` and ``curves.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from hl_core.storage.digests import sha256_file

from . import stats
from .fair import PREFERENCE_FAIR
from .real import REAL
from .report import clamp_binding, per_run, regime, write_report
from .runs import REPO, Run, RunFailed, WorkerPool, accepted_warmups, environment, run_all
from .sources import SOURCES, source_data
from .studies import (
    FULL,
    QUICK,
    RECIPES,  # noqa: F401 (the studies' recipe folder: callers read eval.repro.__main__.RECIPES)
    STUDIES as BASE_STUDIES,
    Grid,
    Study,
    grid_runs,
)

STUDIES = {**BASE_STUDIES, PREFERENCE_FAIR.name: PREFERENCE_FAIR, REAL.name: REAL}


def offline_data(study: Study, cache: Path, grid: Grid, pool: WorkerPool) -> Dict[str, Path]:
    """The preference study's offline data, written once by a weaker model (cached); nothing for other studies."""
    if not any(a.data for a in study.arms):
        return {}
    return source_data(SOURCES["weak"], cache, grid.warmup_overrides, pool, limit=256 if grid.shortened else None)


def choose_regime(study: Study, runs: Sequence[Run]) -> dict:
    """Per choosing arm (the online arm of each objective): the regime with the largest mean gain ``AUC - start``."""
    per: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    for run in runs:
        arm, _, name = run.arm.partition("@")
        if arm in study.choose_by:
            entry = per.setdefault(arm, {}).setdefault(name, {"start": [], "auc": []})
            entry["start"].append(run.curve[1][0])
            entry["auc"].append(stats.curve_auc(*run.curve))
    table = {arm: {name: {"start": sum(v["start"]) / len(v["start"]), "auc": sum(v["auc"]) / len(v["auc"])}
                   for name, v in regimes.items()} for arm, regimes in per.items()}
    for regimes in table.values():
        for v in regimes.values():
            v["gain"] = v["auc"] - v["start"]
    return {"by_arm": table, "chosen": {arm: max(r, key=lambda n: r[n]["gain"]) for arm, r in table.items()}}


def sweep(study: Study, grid: Grid, models, out: Path, seeds, pool: WorkerPool, start: float, data,
          only: Optional[Sequence[str]] = None) -> int:
    runs, labels = [], {}
    for name, (overrides, arm_names) in study.regimes.items():
        if only and name not in only:
            continue
        for arm in (study.arm(a) for a in arm_names):
            runs += grid_runs([arm], grid, models, out, seeds, overrides, tag=f"@{name}", data=data)
            labels[f"{arm.name}@{name}"] = f"{arm.label}, {name}"
    runs = run_all(runs, pool, "sweep")
    meta = {"mode": "sweep", "grid": regime(study, grid), "warmups": sorted(models), "seeds": list(seeds),
            "environment": environment(pool), "wall_s": time.perf_counter() - start}
    references = {r.arm: f"{study.choose_by[0]}@{r.arm.partition('@')[2]}" for r in runs}  # the same regime's
    result = write_report(out, study, runs, labels, meta, f"Regime sweep ({study.name} study)", references=references)
    choice = choose_regime(study, runs)
    binding = per_run(runs, clamp_binding)
    result["regime_choice"] = choice
    result["clamp_binding"] = {arm: sum(v.values()) / len(v) for arm, v in binding.items() if None not in v.values()}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["", "Choosing arm(s) per regime (the gain over its own start, AUC - value at update 0, chooses, so a "
             "lower temperature's higher start does not decide):", "", "| arm | regime | start | AUC | gain |",
             "|---|---|---|---|---|"]
    lines += [f"| {arm} | {name} | {v['start']:.3f} | {v['auc']:.3f} | {v['gain']:+.3f} |"
              for arm, regimes in choice["by_arm"].items() for name, v in regimes.items()]
    lines += ["", "Chosen: " + ", ".join(f"{arm}: **{name}**" for arm, name in choice["chosen"].items()) + ".", ""]
    if result["clamp_binding"]:
        lines += ["Fraction of log-ratio tokens the humanline clamp changed (mean over updates and runs): "
                  + ", ".join(f"{labels.get(a, a)} {v:.4f}" for a, v in result["clamp_binding"].items()) + ".", ""]
    with (out / "results.md").open("a") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


# ------------------------------------------------------------------------------------------------ main
def main(argv: Optional[Sequence[str]] = None, pool: Optional[WorkerPool] = None) -> int:
    """The command line; ``pool``: run in that pool's workers (kept for the caller's next study) instead of a pool of
    ``--jobs`` workers of this call's own (the tests share one pool between the studies' quick grids)."""
    parser = argparse.ArgumentParser(prog="python -m eval.repro", description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=sorted(STUDIES), default="grpo", help="which study (default grpo)")
    parser.add_argument("--quick", action="store_true", help="shortened grid + sanity checks (tests; < 3 min)")
    parser.add_argument("--sweep", action="store_true", help="the regime sweep instead of the study")
    parser.add_argument("--warmups", type=int, default=None, help="warm-up models (default 3; quick 2; sweep 1)")
    parser.add_argument("--seeds", type=int, default=None, help="RL seeds per warm-up (default 2; quick 1; sweep 3)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the CPU count)")
    parser.add_argument("--arms", nargs="*", default=None, help="a subset of arms (default: all)")
    parser.add_argument("--regimes", nargs="*", default=None, help="--sweep: a subset of regimes (default: all)")
    parser.add_argument("--plan", action="store_true", help="print the planned run count and ETA, run nothing "
                        "(studies with stages of their own: preference_fair, real)")
    parser.add_argument("--out", default=None, help="output folder (default runs/repro/<study>[-quick|-sweep])")
    parser.add_argument("--cache", default=None, help="where warm-ups and offline data are cached (default "
                        "runs/repro/cache; quick: the output folder)")
    args = parser.parse_args(argv)

    study = STUDIES[args.study]
    known = {a.name: a for a in study.arms}
    unknown = [a for a in args.arms or [] if a not in known] + [r for r in args.regimes or [] if r not in study.regimes]
    if unknown:
        print(f"error: unknown arm(s) or regime(s) {', '.join(unknown)} in the {study.name} study; arms: "
              f"{', '.join(known)}; regimes: {', '.join(study.regimes)}", file=sys.stderr)
        return 2
    if args.plan and study.runner is None:
        print(f"error: --plan is for the staged studies ({', '.join(n for n, s in STUDIES.items() if s.runner)}); "
              f"the {study.name} study's run count is its arms x warm-ups x seeds", file=sys.stderr)
        return 2
    grid = QUICK if args.quick else FULL
    jobs = args.jobs or study.jobs or max(1, os.cpu_count() or 1)
    mode = "quick" if args.quick else "sweep" if args.sweep else "study"
    out = Path(args.out or REPO / "runs" / "repro" / (study.name + ("" if mode == "study" else f"-{mode}")))
    cache = (Path(args.cache) if args.cache else study.cache if study.cache else out.parent / "cache"
             if not args.quick else out)
    if pool is not None:
        return run_in(pool, args, study, grid, out, cache, mode)
    with WorkerPool(jobs, (cache if study.cache else out) / "workers") as own:
        return run_in(own, args, study, grid, out, cache, mode)


def run_in(pool: WorkerPool, args, study: Study, grid: Grid, out: Path, cache: Path, mode: str) -> int:
    if study.runner is not None:  # a study with its own stages (preference_fair)
        return study.runner(args, grid, out, cache, pool)
    return run_study(args, study, grid, out, cache, pool, mode)


def run_study(args, study: Study, grid: Grid, out: Path, cache: Path, pool: WorkerPool, mode: str) -> int:
    """Warm-ups, offline data, every arm x warm-up x seed, the report (``--sweep``: the regime sweep)."""
    seeds = list(range(args.seeds or (3 if args.sweep else grid.seeds)))
    start = time.perf_counter()
    models, warmup_table = accepted_warmups(cache, grid, args.warmups or (1 if args.sweep else grid.warmups), pool)
    data = offline_data(study, cache, grid, pool)
    if args.sweep:
        return sweep(study, grid, models, out, seeds, pool, start, data, args.regimes)

    known = {a.name: a for a in study.arms}
    labels = {a.name: a.label for a in study.arms + study.quick_extra}
    arms = ([known[a] for a in args.arms] if args.arms
            else [a for a in study.arms if not args.quick or a.name in study.quick_arms])
    runs = grid_runs(arms, grid, models, out, seeds, data=data)
    repeat = None
    if args.quick:
        runs += grid_runs(study.quick_extra, grid, models, out, seeds, data=data)
        repeat = grid_runs([study.arm(study.repeat_arm)], grid, {0: models[0]}, out, seeds[:1], tag="_repeat",
                           data=data)[0]
        runs.append(repeat)
    runs = run_all(runs, pool, mode)
    if repeat is not None:
        repeat = next(r for r in runs if r.arm == repeat.arm)
        runs = [r for r in runs if r is not repeat]
    meta = {"mode": mode, "grid": regime(study, grid), "warmups": sorted(models), "warmup_acceptance": warmup_table,
            "seeds": list(seeds), "environment": environment(pool), "wall_s": time.perf_counter() - start}
    if data:
        meta["offline_data"] = json.loads(data["meta"].read_text())
    checks = study.checks(runs, repeat) if study.checks else {}
    if data:  # the offline data the arms read is the data that was written
        checks["offline_data_unchanged"] = all(sha256_file(data[k]) == meta["offline_data"]["sha256"][k]
                                               for k in ("pairs", "groups"))
    write_report(out, study, runs, labels, meta, study.title, checks, references={a.name: a.reference for a in arms})
    return 0


def cli(argv: Optional[Sequence[str]] = None, pool: Optional[WorkerPool] = None) -> int:
    if __name__ == "__main__":  # the command line: SIGTERM unwinds like Ctrl-C, so the pool's workers end with it
        from hl_core.children import terminate_on_sigterm  # imported here: only the command line installs it

        terminate_on_sigterm()
    try:
        return main(argv, pool)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
