"""Does humanline close the gap between sparse/offline and online GRPO? The reproduction study's driver.

    python -m eval.repro                 # warm-up (cached) + every arm x 5 seeds, ~25 min on 2 cores
    python -m eval.repro --quick         # a shortened grid with the sanity checks (< 3 min)
    python -m eval.repro --sweep         # the regime sweep (online arm; clamp pairs on humanline k=16)

Every run is our own pipeline: ``launchers/run.py`` on a recipe from ``recipes/repro/`` (DeepSpeed on
CPU, rollouts, math reward), one process per run, 1 thread, deterministic algorithms, ``--jobs`` runs
at a time. Writes ``results.json`` (curves, statistics, wall-clock, sanity checks, versions, threads),
``results.md`` and ``curves.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import stats
from .._common import read_jsonl

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes" / "repro"


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: str
    label: str
    schedule: str  # online | sparse | offline: how `rollout.every` scales in a shortened grid
    overrides: Tuple[str, ...] = ()


ARMS: Tuple[Arm, ...] = (
    Arm("online", "online.yaml", "online GRPO", "online"),
    Arm("sparse", "sparse.yaml", "sparse GRPO (every 64)", "sparse"),
    Arm("humanline_sparse_k1", "humanline_sparse_k1.yaml", "humanline sparse, k=1", "sparse"),
    Arm("humanline_sparse_k4", "humanline_sparse_k4.yaml", "humanline sparse, k=4", "sparse"),
    Arm("humanline_sparse_k16", "humanline_sparse_k16.yaml", "humanline sparse, k=16", "sparse"),
    Arm("offline", "offline.yaml", "offline GRPO", "offline"),
    Arm("offline_humanline", "offline_humanline.yaml", "offline humanline, k=1", "offline"),
    Arm("sync_only", "sync_only.yaml", "ablation: sync only (k=1, no clamp)", "sparse"),
    Arm("clip_only", "clip_only.yaml", "ablation: clip only (no sync)", "sparse"),
)
# humanline with k=1 and fresh samples every update: the sanity check that it tracks online
HUMANLINE_ONLINE = Arm("humanline_online_k1", "humanline_sparse_k1.yaml", "humanline online, k=1", "online",
                       ("rollout.every=1",))

# the regime sweep: online arm only (the default regime is chosen by it alone) ...
REGIMES: Dict[str, Tuple[str, ...]] = {
    "lr3e-4": ("train.lr=3e-4",),
    "lr1e-4": ("train.lr=1e-4",),
    "lr3e-5": ("train.lr=3e-5",),
    "lr1e-6": ("train.lr=1e-6",),
    "lr3e-4_kl1e-4": ("train.lr=3e-4", "objective.beta_kl=1e-4"),
    "lr3e-4_T0.7": ("train.lr=3e-4", "rollout.temperature=0.7"),
}
# ... and the clamp pairs on humanline sparse k=16 (reported, never used to choose the regime)
CLAMPS: Dict[str, Tuple[float, float]] = {"+-1.5": (-1.5, 1.5), "-0.1/1.0": (-0.1, 1.0), "-0.1/0.5": (-0.1, 0.5)}


@dataclass
class Grid:
    """A shortened grid (``--quick``): arms keep their schedule shape at a smaller scale. The full study
    (``shortened=False``) runs the recipes as written."""

    shortened: bool = False
    steps: int = 0
    sparse_every: int = 0
    prompts_per_update: int = 0
    eval_every: int = 0
    eval_prompts: int = 0
    warmup_overrides: Tuple[str, ...] = ()  # on top of recipes/repro/warmup.yaml
    seeds: int = 5

    def overrides(self, arm: Arm) -> List[str]:
        if not self.shortened:
            return list(arm.overrides)
        every = {"online": 1, "sparse": self.sparse_every, "offline": self.steps}[arm.schedule]
        return [f"train.max_steps={self.steps}", f"train.micro_batch_size={self.prompts_per_update}",
                f"eval.every={self.eval_every}", f"data.eval.limit={self.eval_prompts}", *arm.overrides,
                f"rollout.every={every}"]


FULL = Grid()
# the quick warm-up: half the batch (~70 s); greedy ~60%, sampled ~16% held-out accuracy
QUICK = Grid(shortened=True, steps=8, sparse_every=4, prompts_per_update=4, eval_every=4, eval_prompts=64,
             warmup_overrides=("train.micro_batch_size=64",), seeds=2)
QUICK_ARMS = ("online", "sparse", "humanline_sparse_k1", "offline", "offline_humanline")


# ------------------------------------------------------------------------------------------------ runs
@dataclass
class Run:
    arm: str
    seed: int
    recipe: Path
    overrides: List[str]
    output_dir: Path
    wall_s: float = 0.0
    curve: Tuple[List[int], List[float]] = field(default_factory=lambda: ([], []))
    metrics: List[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


def child_env() -> Dict[str, str]:
    """One thread per process, fixed hashing: the deterministic settings of every run."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false")
    return env


def run_one(run: Run) -> Run:
    """Train one (arm, seed) through ``launchers/run.py``; reads its curve and metrics back."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "launchers" / "run.py"), str(run.recipe), *run.overrides,
           f"output_dir={run.output_dir}", "logging.progress_bar=false", "checkpoint.resume=never"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    run.wall_s = time.perf_counter() - start
    (run.output_dir / "driver.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RunFailed(f"run {run.arm} seed {run.seed} failed (exit {proc.returncode}); full log: "
                        f"{run.output_dir / 'driver.log'}\ncommand: {' '.join(cmd)}\n{tail}")
    evals = read_jsonl(run.output_dir / "eval.jsonl")
    run.curve = ([int(r["step"]) for r in evals], [float(r["reward"]) for r in evals])
    run.metrics = read_jsonl(run.output_dir / "metrics.jsonl")
    summary_path = run.output_dir / "summary.json"
    run.summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return run


def run_all(runs: Sequence[Run], jobs: int, title: str) -> List[Run]:
    """Run ``runs`` ``jobs`` at a time, printing one line per finished run with an ETA."""
    from tqdm import tqdm

    done: List[Run] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(total=len(runs), desc=title, unit="run") as bar:
        futures = {pool.submit(run_one, r): r for r in runs}
        for future in as_completed(futures):
            run = future.result()
            done.append(run)
            bar.write(f"  {run.arm:<22} seed {run.seed}: {run.wall_s:5.1f}s, held-out accuracy "
                      f"{run.curve[1][0]:.3f} -> {run.curve[1][-1]:.3f}")
            bar.update(1)
    order = {(r.arm, r.seed): i for i, r in enumerate(runs)}
    return sorted(done, key=lambda r: order[(r.arm, r.seed)])


def warmup(out: Path, grid: Grid) -> Path:
    """The supervised warm-up, cached: reused while the recipe, its data and the step count are unchanged."""
    recipe = RECIPES / "warmup.yaml"
    data = REPO / "tests" / "fixtures" / "toy_add" / "sft_train.jsonl"
    key = hashlib.sha256(recipe.read_bytes() + data.read_bytes() + repr(grid.warmup_overrides).encode()).hexdigest()[:16]
    directory = out / f"warmup-{key}"
    final = directory / "final"
    if (final / "config.json").exists():
        print(f"warm-up: cached at {final}")
        return final
    print(f"warm-up: supervised training -> {final}")
    run = Run("warmup", 0, recipe, [*grid.warmup_overrides, "checkpoint.save_final=true"], directory)
    run_one(run)
    print(f"warm-up: {run.wall_s:.0f}s, greedy/sampled start accuracy is measured by the arms at update 0")
    return final


def grid_runs(arms: Sequence[Arm], grid: Grid, model: Path, out: Path, seeds: Sequence[int],
              extra: Sequence[str] = (), tag: str = "") -> List[Run]:
    return [
        Run(arm.name + tag, seed, RECIPES / arm.recipe,
            grid.overrides(arm) + [f"model.name_or_path={model}", f"train.seed={seed}", *extra],
            out / "runs" / (arm.name + tag) / f"seed{seed}")
        for arm in arms for seed in seeds
    ]


# ------------------------------------------------------------------------------------------------ report
def environment(jobs: int) -> dict:
    import deepspeed
    import numpy
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
        "numpy": numpy.__version__, "git_commit": commit or None, "parallel_jobs": jobs,
        "threads_per_process": 1, "deterministic_algorithms": True,
    }


def regime(grid: Grid) -> dict:
    """What every arm shares, as resolved from ``recipes/repro/online.yaml`` (+ the shortened grid)."""
    from hl_core.config import load_recipe

    recipe = load_recipe(RECIPES / "online.yaml", grid.overrides(ARMS[0]))
    return {"shortened": grid.shortened, "train": recipe.train.model_dump(), "rollout": recipe.rollout.model_dump(),
            "objective": recipe.objective.model_dump(), "humanline_clamp": [recipe.humanline.log_eps_P, recipe.humanline.log_eps_R],
            "eval_prompts": recipe.data.eval.limit, "eval_every": recipe.eval.every}


def study_meta(mode: str, grid: Grid, seeds: Sequence[int], jobs: int, start: float) -> dict:
    """What every result file records besides the runs: mode, regime, seeds, environment, wall-clock."""
    return {"mode": mode, "grid": regime(grid), "seeds": list(seeds), "environment": environment(jobs),
            "wall_s": time.perf_counter() - start}


def curves_of(runs: Sequence[Run]) -> Dict[str, Dict[int, Tuple[List[int], List[float]]]]:
    curves: Dict[str, Dict[int, Tuple[List[int], List[float]]]] = {}
    for run in runs:
        curves.setdefault(run.arm, {})[run.seed] = run.curve
    return curves


def wall_clock(runs: Sequence[Run]) -> Dict[str, Dict[str, Dict[int, float]]]:
    """Per arm and seed: the process wall-clock, and the generation (+ scoring) seconds inside it."""
    out: Dict[str, Dict[str, Dict[int, float]]] = {"total": {}, "generation": {}}
    for run in runs:
        out["total"].setdefault(run.arm, {})[run.seed] = run.wall_s
        out["generation"].setdefault(run.arm, {})[run.seed] = sum(float(m.get("rollout_time_s", 0.0)) for m in run.metrics)
    return out


def sanity_checks(runs: Sequence[Run], repeat: Optional[Run]) -> dict:
    """The study's built-in checks: online ratio exactly 1; humanline k=1 online tracks online; one seed
    gives one curve."""
    by = {(r.arm, r.seed): r for r in runs}
    checks: dict = {}
    online = [r for r in runs if r.arm == "online"]
    ratios = [m.get("ratio/mean") for r in online for m in r.metrics]
    checks["online_ratio_exactly_one"] = bool(ratios) and all(v == 1.0 for v in ratios)
    pairs = [(by[("online", r.seed)], r) for r in runs if r.arm == HUMANLINE_ONLINE.name and ("online", r.seed) in by]
    if pairs:
        first = [(a.metrics[0]["loss"], b.metrics[0]["loss"]) for a, b in pairs]
        gaps = [abs(x - y) for a, b in pairs for x, y in zip(a.curve[1], b.curve[1])]
        checks["humanline_k1_online_first_update_loss_equal"] = all(x == y for x, y in first)
        checks["humanline_k1_online_max_curve_gap"] = max(gaps)
        checks["humanline_k1_online_mean_curve_gap"] = sum(gaps) / len(gaps)
    if repeat is not None:
        original = by[(repeat.arm.removesuffix("_repeat"), repeat.seed)]
        checks["same_seed_same_curve"] = repeat.curve == original.curve
        checks["same_seed_same_losses"] = [m["loss"] for m in repeat.metrics] == [m["loss"] for m in original.metrics]
    return checks


def write_report(out: Path, runs: Sequence[Run], labels: Dict[str, str], meta: dict, title: str,
                 checks: Optional[dict] = None, reference_arm: str = "online") -> dict:
    curves = curves_of(runs)
    clocks = wall_clock(runs)
    summary = stats.summarize(curves, reference_arm=reference_arm, wall_clock=clocks["total"])
    for arm, entry in summary["arms"].items():
        entry["generation_s"] = stats.bootstrap_ci(list(clocks["generation"][arm].values()))
    result = {"title": title, **meta, "labels": labels, "summary": summary, "sanity": checks or {},
              "runs": [{"arm": r.arm, "seed": r.seed, "steps": r.curve[0], "accuracy": r.curve[1], "wall_s": r.wall_s,
                        "generation_s": clocks["generation"][r.arm][r.seed], "overrides": r.overrides,
                        "torch_threads": r.summary.get("torch_threads"),
                        "deterministic": r.summary.get("deterministic")} for r in runs]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# {title}", "", stats.markdown_table(summary, labels), "",
             "Generation (+ scoring) seconds per run, mean over seeds: "
             + ", ".join(f"{labels.get(a, a)} {e['generation_s']['mean']:.1f}" for a, e in summary["arms"].items()), ""]
    if checks:
        lines += ["Sanity checks: " + ", ".join(f"{k} = {v:.4f}" if isinstance(v, float) else f"{k} = {v}"
                                                for k, v in checks.items()), ""]
    lines += [f"Held-out accuracy: one sampled completion (T = the arm's temperature) per held-out prompt, "
              f"exact answer. {meta['environment']['cpu_count']} CPUs, {meta['environment']['parallel_jobs']} runs at a "
              f"time, 1 thread each, deterministic algorithms; torch {meta['environment']['torch']}, "
              f"transformers {meta['environment']['transformers']}, deepspeed {meta['environment']['deepspeed']}; "
              f"study wall-clock {meta['wall_s'] / 60:.1f} min.", ""]
    (out / "results.md").write_text("\n".join(lines))
    stats.plot_curves(curves, out / "curves.png", labels=labels, title=title)
    print("\n".join(lines))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'curves.png'}")
    return result


def choose_regime(runs: Sequence[Run]) -> dict:
    """The study's regime, by the online arm alone: the largest mean gain ``AUC - start accuracy``."""
    per: Dict[str, Dict[str, List[float]]] = {}
    for run in runs:
        if run.arm.startswith("online@"):
            entry = per.setdefault(run.arm.split("@", 1)[1], {"start": [], "auc": []})
            entry["start"].append(run.curve[1][0])
            entry["auc"].append(stats.curve_auc(*run.curve))
    table = {name: {"start": sum(v["start"]) / len(v["start"]), "auc": sum(v["auc"]) / len(v["auc"])} for name, v in per.items()}
    for v in table.values():
        v["gain"] = v["auc"] - v["start"]
    return {"online": table, "chosen": max(table, key=lambda name: table[name]["gain"])}


# ------------------------------------------------------------------------------------------------ main
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.repro", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shortened grid + sanity checks (tests; < 3 min)")
    parser.add_argument("--sweep", action="store_true", help="the regime sweep instead of the study")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per arm (default 5; quick 2; sweep 3)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: the CPU count)")
    parser.add_argument("--arms", nargs="*", default=None, help="a subset of arms (default: all)")
    parser.add_argument("--out", default=None, help="output folder (default runs/repro/study, -quick, -sweep)")
    args = parser.parse_args(argv)

    known = {a.name: a for a in ARMS}
    unknown = [a for a in args.arms or [] if a not in known]
    if unknown:
        print(f"error: unknown arm(s) {', '.join(unknown)}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    grid = QUICK if args.quick else FULL
    seeds = list(range(args.seeds or (3 if args.sweep else grid.seeds)))
    jobs = args.jobs or max(1, os.cpu_count() or 1)
    mode = "quick" if args.quick else "sweep" if args.sweep else "study"
    out = Path(args.out or REPO / "runs" / "repro" / {"study": "study", "quick": "quick", "sweep": "sweep"}[mode])
    start = time.perf_counter()
    model = warmup(out.parent / "cache" if not args.quick else out, grid)
    labels = {a.name: a.label for a in ARMS + (HUMANLINE_ONLINE,)}

    if args.sweep:
        runs = []
        for name, overrides in REGIMES.items():
            runs += grid_runs([known["online"]], grid, model, out, seeds, overrides, tag=f"@{name}")
            labels[f"online@{name}"] = f"online, {name}"
        for name, (low, high) in CLAMPS.items():
            arm = known["humanline_sparse_k16"]
            runs += grid_runs([arm], grid, model, out, seeds, (f"humanline.log_eps_P={low}", f"humanline.log_eps_R={high}"),
                              tag=f"@clamp{name}")
            labels[f"{arm.name}@clamp{name}"] = f"humanline sparse k=16, clamp {name}"
        runs = run_all(runs, jobs, "sweep")
        meta = study_meta(mode, grid, seeds, jobs, start)
        result = write_report(out, runs, labels, meta, "Regime sweep (online arm chooses the regime)",
                              reference_arm=f"online@{next(iter(REGIMES))}")
        choice = choose_regime(runs)
        result["regime_choice"] = choice
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        lines = ["", "Online arm per regime (held-out accuracy at the regime's own temperature; the regime is chosen by "
                 "the gain over its own start, AUC - accuracy at update 0, so a lower temperature's higher start "
                 "does not decide):", "", "| regime | start | AUC | gain |", "|---|---|---|---|"]
        lines += [f"| {name} | {v['start']:.3f} | {v['auc']:.3f} | {v['gain']:+.3f} |" for name, v in choice["online"].items()]
        lines += ["", f"Chosen: **{choice['chosen']}**."]
        with (out / "results.md").open("a") as fh:
            fh.write("\n".join(lines) + "\n")
        print("\n".join(lines))
        return 0

    arms = [known[a] for a in args.arms] if args.arms else [a for a in ARMS if not args.quick or a.name in QUICK_ARMS]
    runs = grid_runs(arms, grid, model, out, seeds)
    repeat = None
    if args.quick:
        runs += grid_runs([HUMANLINE_ONLINE], grid, model, out, seeds)
        repeat = grid_runs([known["online"]], grid, model, out, seeds[:1], tag="_repeat")[0]
        runs.append(repeat)
    runs = run_all(runs, jobs, mode)
    if repeat is not None:
        repeat = next(r for r in runs if r.arm == repeat.arm)
        runs = [r for r in runs if r is not repeat]
    meta = study_meta(mode, grid, seeds, jobs, start)
    checks = sanity_checks(runs, repeat)
    write_report(out, runs, labels, meta, "Does humanline close the gap? (toy addition, GRPO)", checks)
    return 0


class RunFailed(RuntimeError):
    """One training run of the study exited non-zero (its log is in ``<run dir>/driver.log``)."""


def cli(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return main(argv)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(cli())
