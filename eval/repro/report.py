"""The studies' result files: ``results.json`` (curves, statistics, wall-clock, sanity checks, versions, threads),
``results.md`` and ``curves.png``, and the per-run measures they report (generation time, clamp binding)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import stats
from .kernels import describe
from .runs import Run
from .studies import RECIPES, Grid, Study


def regime(study: Study, grid: Grid) -> dict:
    """What every arm shares, as resolved from the study's first online arm (+ the shortened grid)."""
    from hl_core.config import load_recipe

    arm = study.arm(study.choose_by[0])
    recipe = load_recipe(RECIPES / arm.recipe, grid.overrides(arm))
    return {"shortened": grid.shortened, "train": recipe.train.model_dump(), "rollout": recipe.rollout.model_dump(),
            "objective": recipe.objective.model_dump(),
            "humanline_clamp": [recipe.humanline.log_eps_P, recipe.humanline.log_eps_R],
            "eval_prompts": recipe.data.eval.limit, "eval_every": recipe.eval.every}


def curves_of(runs: Sequence[Run],
              win_rate: bool = False) -> Dict[str, Dict[Tuple[int, int], Tuple[List[int], List[float]]]]:
    """``curves[arm][(warm-up, seed)]`` (held-out metric, or win rate against the start), ``stats.summarize``'s
    layout."""
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
    lines = [f"# {title}", "", f"{study.metric[0].upper()}{study.metric[1:]}:", "",
             stats.markdown_table(summary, labels), ""]
    if win_summary:
        lines += ["Win rate against the start policy (one sampled completion per held-out prompt, ties count half):",
                  "", stats.markdown_table(win_summary, labels), ""]
    lines += ["Generation (+ scoring) seconds per run, mean over runs: "
              + ", ".join(f"{labels.get(a, a)} {e['generation_s']['mean']:.1f}" for a, e in summary["arms"].items()),
              ""]
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
              f"commit {env['git_commit']}; {describe(env.get('kernel_fingerprint'))}; study wall-clock "
              f"{meta['wall_s'] / 60:.1f} min.", ""]
    (out / "results.md").write_text("\n".join(lines))
    stats.plot_curves(curves, out / "curves.png", labels=labels, title=title, ylabel=study.metric)
    print("\n".join(lines))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'curves.png'}")
    return result
