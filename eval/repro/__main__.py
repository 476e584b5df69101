"""Reproduction studies through our own pipeline: does humanline close the gap to online training?

    python -m eval.repro                           # GRPO study: 3 warm-ups (cached) x 9 arms x 2 seeds
    python -m eval.repro --study preference        # DPO / KTO / GRPO, offline vs online vs offline humanline
    python -m eval.repro [--study S] --quick       # a shortened grid with the sanity checks (< 3 min)
    python -m eval.repro [--study S] --sweep       # the regime sweep (chosen by the online arm(s) alone)
    python -m eval.repro --sweep --regimes lr1e-4 lr1e-4_T0.7   # some of its regimes

Every run is ``launchers/run.py`` on a recipe from ``recipes/repro/`` (DeepSpeed on CPU, rollouts, rewards),
one process per run, 1 thread, deterministic algorithms, ``--jobs`` runs at a time. The warm-up model is a
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
from typing import Dict, List, Optional, Sequence, Tuple

from . import stats
from .preference import file_digest
from .._common import read_jsonl
from .runs import REPO, WARMUP_RECIPE, Run, RunFailed, environment, run_all, warmups
from .studies import FULL, QUICK, RECIPES, STUDIES, Arm, Grid, Study


def grid_runs(arms: Sequence[Arm], grid: Grid, models: Dict[int, Path], out: Path, seeds: Sequence[int],
              extra: Sequence[str] = (), tag: str = "", data: Optional[Dict[str, Path]] = None) -> List[Run]:
    """Every arm x warm-up model x RL seed (the same RL seeds under each warm-up: a crossed design)."""
    runs = []
    for arm in arms:
        data_override = [f"data.train.path={(data or {})[arm.data]}"] if arm.data else []
        for w, model in models.items():
            for seed in seeds:
                runs.append(Run(arm.name + tag, seed, RECIPES / arm.recipe,
                                grid.overrides(arm) + data_override + [f"model.name_or_path={model}",
                                                                       f"train.seed={seed}", *extra],
                                out / "runs" / (arm.name + tag) / f"warmup{w}-seed{seed}", warmup=w))
    return runs


WARMUP_EVAL = ("data.eval.path=tests/fixtures/toy_add/prompts_eval.jsonl", "data.eval.limit=256", "eval.at_start=false",
               "eval.held_out=reward", "rollout.reward.kind=math", "rollout.temperature=1.0", "rollout.max_new_tokens=4")


def accepted_warmups(cache: Path, grid: Grid, count: int, jobs: int) -> Tuple[Dict[int, Path], List[dict]]:
    """The first ``count`` warm-up seeds (0, 1, 2, ...) whose held-out accuracy at the end of the warm-up (one
    sampled answer per held-out problem, the arms' measure) reaches ``grid.warmup_min_accuracy``: a warm-up that
    did not learn the task is not a start. Returns the accepted models and every tried seed's accuracy."""
    from hl_core.config import load_recipe

    steps = load_recipe(WARMUP_RECIPE, list(grid.warmup_overrides)).train.max_steps
    overrides = [*grid.warmup_overrides, *WARMUP_EVAL, f"eval.every={steps}"]
    models: Dict[int, Path] = {}
    table: List[dict] = []
    seed = 0
    while len(models) < count:
        if seed >= 2 * count + 2:
            raise RunFailed(f"only {len(models)} of {seed} warm-up seeds reached held-out accuracy "
                            f"{grid.warmup_min_accuracy} (tried: {table}); check recipes/repro/warmup.yaml")
        batch = list(range(seed, seed + count - len(models)))
        built = warmups(cache, overrides, batch, jobs)
        for s in batch:
            accuracy = float(read_jsonl(built[s].parent / "eval.jsonl")[-1]["reward"])
            table.append({"seed": s, "accuracy": accuracy, "accepted": accuracy >= grid.warmup_min_accuracy})
            if table[-1]["accepted"]:
                models[s] = built[s]
            else:
                print(f"warm-up {s}: held-out accuracy {accuracy:.3f} < {grid.warmup_min_accuracy}: not a start, "
                      "drawing the next seed")
        seed += len(batch)
    return models, table


def offline_data(study: Study, cache: Path, grid: Grid, jobs: int) -> Dict[str, Path]:
    """The preference study's offline data, written once by a weaker model (cached); nothing for other studies."""
    if not any(a.data for a in study.arms):
        return {}
    from .preference import WEAK_SEED, WEAK_WARMUP_OVERRIDES, build_offline_data

    weak = warmups(cache, [*grid.warmup_overrides, *WEAK_WARMUP_OVERRIDES], [WEAK_SEED], jobs, name="weak-model")
    return build_offline_data(weak[WEAK_SEED], cache, limit=256 if grid.shortened else None)


# ------------------------------------------------------------------------------------------------ report
def regime(study: Study, grid: Grid) -> dict:
    """What every arm shares, as resolved from the study's first online arm (+ the shortened grid)."""
    from hl_core.config import load_recipe

    arm = study.arm(study.choose_by[0])
    recipe = load_recipe(RECIPES / arm.recipe, grid.overrides(arm))
    return {"shortened": grid.shortened, "train": recipe.train.model_dump(), "rollout": recipe.rollout.model_dump(),
            "objective": recipe.objective.model_dump(), "humanline_clamp": [recipe.humanline.log_eps_P, recipe.humanline.log_eps_R],
            "eval_prompts": recipe.data.eval.limit, "eval_every": recipe.eval.every}


def curves_of(runs: Sequence[Run], win_rate: bool = False) -> Dict[str, Dict[Tuple[int, int], Tuple[List[int], List[float]]]]:
    """``curves[arm][(warm-up, seed)]`` (held-out metric, or win rate against the start), ``stats.summarize``'s layout."""
    curves: Dict[str, Dict[Tuple[int, int], Tuple[List[int], List[float]]]] = {}
    for run in runs:
        curves.setdefault(run.arm, {})[(run.warmup, run.seed)] = (run.curve[0], run.win_rate) if win_rate else run.curve
    return curves


def per_run(runs: Sequence[Run], value) -> Dict[str, Dict[Tuple[int, int], float]]:
    out: Dict[str, Dict[Tuple[int, int], float]] = {}
    for run in runs:
        out.setdefault(run.arm, {})[(run.warmup, run.seed)] = value(run)
    return out


def generation_s(run: Run) -> float:
    return sum(float(m.get("rollout_time_s", 0.0)) for m in run.metrics)


def clamp_binding(run: Run) -> Optional[float]:
    """Mean fraction of log-ratio tokens the humanline clamp changed (None without a clamp)."""
    values = [1.0 - float(m["unclamped_frac"]) for m in run.metrics if m.get("unclamped_frac") is not None]
    return sum(values) / len(values) if values else None


def write_report(out: Path, study: Study, runs: Sequence[Run], labels: Dict[str, str], meta: dict, title: str,
                 checks: Optional[dict] = None, references: Optional[Dict[str, str]] = None) -> dict:
    curves = curves_of(runs)
    summary = stats.summarize(curves, reference_arm=study.choose_by[0], wall_clock=per_run(runs, lambda r: r.wall_s),
                              references=references)
    generation = per_run(runs, generation_s)
    for arm, entry in summary["arms"].items():
        entry["generation_s"] = stats.grouped_ci(generation[arm])
    win = {a: c for a, c in curves_of(runs, win_rate=True).items() if all(len(v[1]) == len(v[0]) for v in c.values())}
    win_summary = stats.summarize(win, reference_arm=study.choose_by[0], references=references) if win else None
    result = {"title": title, "study": study.name, **meta, "labels": labels, "summary": summary,
              "win_rate_summary": win_summary, "sanity": checks or {},
              "runs": [{"arm": r.arm, "warmup": r.warmup, "seed": r.seed, "steps": r.curve[0], "values": r.curve[1],
                        "win_rate": r.win_rate, "losses": [m.get("loss") for m in r.metrics],
                        "grad_norms": [m.get("grad_norm") for m in r.metrics],
                        "reward_means": [m.get("reward_mean") for m in r.metrics], "wall_s": r.wall_s,
                        "generation_s": generation_s(r), "clamp_binding": clamp_binding(r), "overrides": r.overrides,
                        "torch_threads": r.summary.get("torch_threads"),
                        "deterministic": r.summary.get("deterministic")} for r in runs]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# {title}", "", f"{study.metric[0].upper()}{study.metric[1:]}:", "", stats.markdown_table(summary, labels), ""]
    if win_summary:
        lines += ["Win rate against the start policy (one sampled completion per held-out prompt, ties count half):",
                  "", stats.markdown_table(win_summary, labels), ""]
    lines += ["Generation (+ scoring) seconds per run, mean over runs: "
              + ", ".join(f"{labels.get(a, a)} {e['generation_s']['mean']:.1f}" for a, e in summary["arms"].items()), ""]
    if checks:
        lines += ["Sanity checks: " + ", ".join(f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}"
                                                for k, v in checks.items()), ""]
    if meta.get("warmup_acceptance"):
        lines += ["Warm-ups tried (accepted at held-out accuracy >= the grid's minimum, fixed before any RL run): "
                  + ", ".join(f"seed {w['seed']} {w['accuracy']:.3f} ({'accepted' if w['accepted'] else 'rejected'})"
                              for w in meta["warmup_acceptance"]), ""]
    env = meta["environment"]
    lines += [f"{study.metric[0].upper()}{study.metric[1:]}: one sampled completion (T = the arm's temperature) per "
              f"held-out prompt. {len(meta['warmups'])} warm-up model(s) x {len(meta['seeds'])} RL seed(s) per arm. "
              f"{env['cpu_count']} CPUs, {env['parallel_jobs']} runs at a time, 1 thread each, deterministic "
              f"algorithms; torch {env['torch']}, transformers {env['transformers']}, deepspeed {env['deepspeed']}; "
              f"commit {env['git_commit']}; study wall-clock {meta['wall_s'] / 60:.1f} min.", ""]
    (out / "results.md").write_text("\n".join(lines))
    stats.plot_curves(curves, out / "curves.png", labels=labels, title=title, ylabel=study.metric)
    print("\n".join(lines))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'curves.png'}")
    return result


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


def sweep(study: Study, grid: Grid, models, out: Path, seeds, jobs: int, start: float, data,
          only: Optional[Sequence[str]] = None) -> int:
    runs, labels = [], {}
    for name, (overrides, arm_names) in study.regimes.items():
        if only and name not in only:
            continue
        for arm in (study.arm(a) for a in arm_names):
            runs += grid_runs([arm], grid, models, out, seeds, overrides, tag=f"@{name}", data=data)
            labels[f"{arm.name}@{name}"] = f"{arm.label}, {name}"
    runs = run_all(runs, jobs, "sweep")
    meta = {"mode": "sweep", "grid": regime(study, grid), "warmups": sorted(models), "seeds": list(seeds),
            "environment": environment(jobs), "wall_s": time.perf_counter() - start}
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
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.repro", description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", choices=sorted(STUDIES), default="grpo", help="which study (default grpo)")
    parser.add_argument("--quick", action="store_true", help="shortened grid + sanity checks (tests; < 3 min)")
    parser.add_argument("--sweep", action="store_true", help="the regime sweep instead of the study")
    parser.add_argument("--warmups", type=int, default=None, help="warm-up models (default 3; quick 2; sweep 1)")
    parser.add_argument("--seeds", type=int, default=None, help="RL seeds per warm-up (default 2; quick 1; sweep 3)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the CPU count)")
    parser.add_argument("--arms", nargs="*", default=None, help="a subset of arms (default: all)")
    parser.add_argument("--regimes", nargs="*", default=None, help="--sweep: a subset of regimes (default: all)")
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
    grid = QUICK if args.quick else FULL
    seeds = list(range(args.seeds or (3 if args.sweep else grid.seeds)))
    jobs = args.jobs or max(1, os.cpu_count() or 1)
    mode = "quick" if args.quick else "sweep" if args.sweep else "study"
    out = Path(args.out or REPO / "runs" / "repro" / (study.name + ("" if mode == "study" else f"-{mode}")))
    cache = Path(args.cache) if args.cache else out.parent / "cache" if not args.quick else out
    start = time.perf_counter()
    models, warmup_table = accepted_warmups(cache, grid, args.warmups or (1 if args.sweep else grid.warmups), jobs)
    data = offline_data(study, cache, grid, jobs)
    if args.sweep:
        return sweep(study, grid, models, out, seeds, jobs, start, data, args.regimes)

    labels = {a.name: a.label for a in study.arms + study.quick_extra}
    arms = [known[a] for a in args.arms] if args.arms else [a for a in study.arms if not args.quick or a.name in study.quick_arms]
    runs = grid_runs(arms, grid, models, out, seeds, data=data)
    repeat = None
    if args.quick:
        runs += grid_runs(study.quick_extra, grid, models, out, seeds, data=data)
        repeat = grid_runs([study.arm(study.repeat_arm)], grid, {0: models[0]}, out, seeds[:1], tag="_repeat", data=data)[0]
        runs.append(repeat)
    runs = run_all(runs, jobs, mode)
    if repeat is not None:
        repeat = next(r for r in runs if r.arm == repeat.arm)
        runs = [r for r in runs if r is not repeat]
    meta = {"mode": mode, "grid": regime(study, grid), "warmups": sorted(models), "warmup_acceptance": warmup_table,
            "seeds": list(seeds), "environment": environment(jobs), "wall_s": time.perf_counter() - start}
    if data:
        meta["offline_data"] = json.loads(data["meta"].read_text())
    checks = study.checks(runs, repeat) if study.checks else {}
    if data:  # the offline data the arms read is the data that was written
        checks["offline_data_unchanged"] = all(file_digest(data[k]) == meta["offline_data"]["sha256"][k]
                                               for k in ("pairs", "groups"))
    write_report(out, study, runs, labels, meta, study.title, checks, references={a.name: a.reference for a in arms})
    return 0


def cli(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return main(argv)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
