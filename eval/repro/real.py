"""The real-model study (``python -m eval.repro --study real``, issue 55): offline, offline + humanline and online
GRPO on SmolLM2-135M-Instruct, on the demo's two-digit additions (``recipes/real/study/``), seed by seed.

* Arms: ``online`` (plain GRPO, fresh samples every update), ``offline`` (plain GRPO on a fixed set of groups
  sampled once from the initial model: the same prompts and samples per prompt the online arm draws over its run;
  the ratio against that behaviour policy, never synced), ``offline_humanline`` (the same set, sync every update
  and clip +-1.5), ``online_humanline`` (the demo recipe), and the ablations ``offline_sync_only`` and
  ``offline_clip_only``. Every arm has the demo's budget (chosen on online humanline; nothing was tuned on an
  offline arm).
* The offline set is a random factor: each seed samples its own (``write_offline_set``: the offline recipe's
  rollout at update 0, every update's groups, by the pack's own rollout code), cached and shared by that seed's
  offline arms through ``rollout.replay``; its generation time is recorded once.
* Every cell (arm, seed) is ``launchers/run.py``'s ``main()`` in a study worker (1 thread, deterministic algorithms,
  the AVX2 kernels: ``eval.repro.runs``), then its greedy held-out answers (``eval.addition.greedy_accuracy``).
  A finished cell is recorded in ``--out``'s ``results.json`` under a key of its recipes (as parsed), the task's
  data and code and its overrides; a re-run skips it, so the study completes over several sittings. The report is
  rewritten after every cell (``eval.repro.real_report``).

    python -m eval.repro --study real --plan                  # cells, offline sets, ETA; runs nothing
    python -m eval.repro --study real --jobs 1 --out docs/results/real-study   # the committed study (resumes it)
    python -m eval.repro --study real --arms offline_humanline --seeds 1 --out /tmp/check   # one cell again
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

from .._common import read_jsonl
from .runs import REPO, Run, RunFailed, WorkerPool, environment, run_all
from .studies import Arm, Study

STUDY = REPO / "recipes" / "real" / "study"
DEMO = REPO / "recipes" / "real" / "smollm2_addition_grpo.yaml"
DOCS = REPO / "docs" / "results" / "real-study"
SET_RECIPE = STUDY / "offline_humanline.yaml"  # writes the sets: its rollout computes no behaviour log-probs
# every cell: one thread, deterministic algorithms, `final/` (its merged model answers the greedy evaluation)
COMMON = ("train.deterministic=true", "train.num_threads=1", "checkpoint.save_final=true",
          "checkpoint.save_every=null", "model.lora.save_merged=true")


@dataclass(frozen=True)
class RealArm:
    name: str
    recipe: Path
    label: str
    offline: bool  # trains on the seed's offline set (replayed), sampled once from the initial model
    core: bool  # the acceptance's arms run first; the others when time allows


ARMS: Tuple[RealArm, ...] = (
    RealArm("offline", STUDY / "offline.yaml", "offline GRPO", True, True),
    RealArm("offline_humanline", STUDY / "offline_humanline.yaml", "offline humanline GRPO (k=1, clip +-1.5)",
            True, True),
    RealArm("online", STUDY / "online.yaml", "online GRPO", False, True),
    RealArm("online_humanline", DEMO, "online humanline GRPO (the demo)", False, False),
    RealArm("offline_sync_only", STUDY / "offline_sync_only.yaml", "ablation: offline, sync only (k=1)", True, False),
    RealArm("offline_clip_only", STUDY / "offline_clip_only.yaml", "ablation: offline, clip only", True, False),
)
ARM = {a.name: a for a in ARMS}
LABELS = {a.name: a.label for a in ARMS}


@dataclass(frozen=True)
class RealGrid:
    """The budget every cell shares: ``steps`` updates (the offline set holds all of them) and the overrides on top
    of the arm's recipe."""

    steps: int
    overrides: Tuple[str, ...]
    shortened: bool = False
    # per-cell seconds on an idle 2-core machine, for --plan before any cell of this grid has run (a loaded machine
    # takes 2-4x): an arm's run, an offline set, a greedy evaluation
    estimate_s: Dict[str, float] = field(default_factory=dict)


# the demo's budget (12 updates, 4 prompts x 8 samples, lr 2e-3, k=1, clip +-1.5), every held-out problem (48) in
# the sampled held-out reward instead of the demo's first 32
FULL_REAL = RealGrid(12, ("data.eval.limit=48", "eval.batch_size=48"),
                     estimate_s={"online": 600.0, "offline": 420.0, "set": 240.0, "greedy": 60.0})
# a smoke test of the whole pipeline on the real model (minutes): 2 updates of 2 prompts x 4 samples
QUICK_REAL = RealGrid(2, ("train.max_steps=2", "train.micro_batch_size=2", "rollout.num_generations=4",
                          "data.eval.limit=4", "eval.batch_size=4", "eval.every=2"), shortened=True,
                      estimate_s={"online": 90.0, "offline": 70.0, "set": 30.0, "greedy": 40.0})


# ------------------------------------------------------------------------------------------------ cells
def recipe_chain(path: Path) -> List[Path]:
    """``path`` and every recipe it extends (``defaults:``, depth first), each once."""
    chain, todo = [], [Path(path)]
    while todo:
        current = todo.pop(0).resolve()
        if current in chain:
            continue
        chain.append(current)
        data = yaml.safe_load(current.read_text()) or {}
        todo += [current.parent / d for d in data.get("defaults", [])]
    return chain


def task_code() -> str:
    """The task's code that decides a cell's numbers: the reward, the answer parsing, the greedy evaluation and the
    held-out problems (their sources: a comment or an import elsewhere in the module does not count)."""
    from eval import addition

    parts = [inspect.getsource(f) for f in (addition.sum_credit, addition.completion_number, addition.holds_sum,
                                             addition.greedy_accuracy, addition.problems)]
    return "\n".join(parts + [addition._NUMBER.pattern, addition.SYSTEM_PROMPT])


def content_key(recipe: Path, overrides: Sequence[str]) -> str:
    """What decides a cell's numbers: its recipes as parsed (comments do not count), the task's data files and code
    (``task_code``), the overrides."""
    digest = hashlib.sha256()
    for path in recipe_chain(recipe):
        parsed = yaml.safe_load(path.read_text()) or {}
        digest.update(f"{path.relative_to(REPO)}\0{json.dumps(parsed, sort_keys=True)}\0".encode())
    for path in sorted((REPO / "recipes" / "real" / "data").glob("*.jsonl")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    digest.update(task_code().encode())
    digest.update(json.dumps(list(overrides)).encode())
    return digest.hexdigest()[:16]


def set_overrides(grid: RealGrid, seed: int) -> List[str]:
    """The offline set's writer: the offline recipe's rollout at update 0 under ``seed``."""
    return [*grid.overrides, *COMMON, f"train.seed={seed}", f"rollout.every={grid.steps}"]


def set_key(grid: RealGrid, seed: int) -> str:
    return content_key(SET_RECIPE, set_overrides(grid, seed))


def cell_overrides(arm: RealArm, grid: RealGrid, seed: int) -> List[str]:
    """The arm's overrides on top of its recipe (without the offline set's path, which the driver adds)."""
    schedule = [f"rollout.every={grid.steps}"] if arm.offline else ["rollout.log_samples=true"]
    return [*grid.overrides, *COMMON, f"train.seed={seed}", *schedule]


def cell_key(arm: RealArm, grid: RealGrid, seed: int) -> str:
    extra = [f"offline set {set_key(grid, seed)}"] if arm.offline else []
    return content_key(arm.recipe, cell_overrides(arm, grid, seed) + extra)


def plan_cells(arms: Sequence[RealArm], seeds: Sequence[int]) -> List[Tuple[RealArm, int]]:
    """Every (arm, seed) in running order: the core arms seed by seed first, then the others seed by seed."""
    order = [a for a in arms if a.core] + [a for a in arms if not a.core]
    return ([(a, s) for s in seeds for a in order if a.core] + [(a, s) for s in seeds for a in order if not a.core])


def pending(cells: Sequence[Tuple[RealArm, int]], done: Dict[Tuple[str, int], dict],
            grid: RealGrid) -> List[Tuple[RealArm, int]]:
    """The cells without a finished record of the same key (a changed recipe, data or override runs again)."""
    return [(a, s) for a, s in cells if done.get((a.name, s), {}).get("key") != cell_key(a, grid, s)]


def load_results(out: Path) -> dict:
    """``out/results.json`` (the finished cells and offline sets), or an empty study."""
    path = out / "results.json"
    return json.loads(path.read_text()) if path.exists() else {"runs": [], "offline_sets": []}


# ------------------------------------------------------------------------------------------------ plan
def estimates(grid: RealGrid, results: dict) -> Dict[str, float]:
    """Per-cell seconds: the recorded means of this grid's finished cells where there are some, else the grid's."""
    table = dict(grid.estimate_s)
    runs = [r for r in results.get("runs", []) if r.get("shortened", False) == grid.shortened]
    for name in ("online", "offline"):
        walls = [r["wall_s"] for r in runs if ARM[r["arm"]].offline == (name == "offline")]
        if walls:
            table[name] = statistics.fmean(walls)
    greedy = [r["greedy_wall_s"] for r in runs if "greedy_wall_s" in r]
    sets = [s["generation_wall_s"] + s.get("setup_wall_s", 0.0) for s in results.get("offline_sets", [])
            if s.get("shortened", False) == grid.shortened]
    table.update({k: statistics.fmean(v) for k, v in (("greedy", greedy), ("set", sets)) if v})
    return table


def plan_text(cells: Sequence[Tuple[RealArm, int]], todo: Sequence[Tuple[RealArm, int]], sets: Sequence[int],
              grid: RealGrid, results: dict, jobs: int) -> Tuple[str, float]:
    """The planned cells, offline sets and an ETA (one line per arm)."""
    table = estimates(grid, results)
    eta = (sum(table["offline" if a.offline else "online"] + table["greedy"] for a, _ in todo)
           + table["set"] * len(sets)) / jobs
    source = "recorded in results.json" if results.get("runs") else "of an idle 2-core machine"
    lines = [f"plan: {len(cells)} cells ({len(cells) - len(todo)} finished, skipped; {len(todo)} to run) and "
             f"{len(sets)} offline set(s) to sample (not cached); {grid.steps} updates per cell; {jobs} run(s) at a "
             f"time; ETA "
             f"{eta / 60:.0f} min (per-cell times {source}; a loaded machine takes 2-4x)"]
    for arm in dict.fromkeys(a for a, _ in cells):
        seeds = [s for a, s in cells if a is arm]
        left = [s for a, s in todo if a is arm]
        lines.append(f"  {arm.name:<20} seeds {seeds}: {len(left)} to run {left if left else ''}".rstrip())
    return "\n".join(lines), eta


# ------------------------------------------------------------------------------------------------ offline sets
def write_offline_set(recipe: str, overrides: List[str], out: str) -> dict:
    """Sample one offline set: the recipe's rollout at update 0 (``rollout.every`` = ``train.max_steps``: every
    update's groups, from the initial policy), by the pack's own trainer and rollout code, logged with
    ``rollout.log_samples``; no update is taken. Runs in a study worker (``pool.ask``).

    Args:
        recipe: the offline recipe; overrides: its overrides (seed, grid); out: the set's folder (``rollouts/`` and
            ``set.json`` are written there, once).

    Returns:
        ``set.json``'s content: groups, samples per group, the (update, position, prompt) list, the mean score,
        the log's sha256, and the generation's wall-clock and CPU seconds (sampling and scoring).
    """
    from hl_core.config import load_recipe
    from hl_core.storage.digests import sha256_file
    from hl_core.trainer import Trainer

    folder = Path(out)
    if (folder / "set.json").exists():
        return json.loads((folder / "set.json").read_text())
    work = folder.with_name(folder.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    setup = time.perf_counter()
    config = load_recipe(recipe, [*overrides, f"output_dir={work}", "rollout.log_samples=true", "eval.every=null",
                                  "checkpoint.resume=never", "checkpoint.overwrite=true", "checkpoint.save_final=false",
                                  "logging.progress_bar=false"])
    trainer = Trainer(config)
    try:
        trainer.setup()
        setup, wall, cpu = time.perf_counter() - setup, time.perf_counter(), time.process_time()
        trainer.source.before_step(0)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        trainer.close()
    rows = [row for path in sorted((work / "rollouts").glob("rank*.jsonl")) for row in read_jsonl(path)]
    folder.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder / "rollouts", ignore_errors=True)
    shutil.move(str(work / "rollouts"), str(folder / "rollouts"))
    shutil.rmtree(work, ignore_errors=True)
    meta = {"groups": len(rows), "samples_per_group": sorted({len(r["completion_ids"]) for r in rows}),
            "cells": [[r["train_step"], r["position"], r["prompt"][-1]["content"]] for r in rows],
            "score_mean": statistics.fmean(s for r in rows for s in r["scores"]),
            "sha256": {p.name: sha256_file(p) for p in sorted((folder / "rollouts").glob("rank*.jsonl"))},
            "generation_wall_s": wall, "generation_cpu_s": cpu, "setup_wall_s": setup,
            "updates": config.train.max_steps, "seed": config.train.seed}
    (folder / "set.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def set_folder(cache: Path, grid: RealGrid, seed: int) -> Path:
    """Where the seed's offline set is cached (``rollouts/`` and ``set.json``)."""
    return cache / "sets" / f"seed{seed}-{set_key(grid, seed)}"


def offline_set(grid: RealGrid, seed: int, cache: Path, pool: WorkerPool) -> Tuple[Path, dict]:
    """The seed's offline set (sampled in a worker unless cached): its ``rollouts/`` folder and its record."""
    key = set_key(grid, seed)
    folder = set_folder(cache, grid, seed)
    log = cache / "logs" / f"offline-set-seed{seed}.log"
    start = time.perf_counter()
    answer = pool.ask({"call": "eval.repro.real:write_offline_set", "log": str(log),
                       "kwargs": {"recipe": str(SET_RECIPE), "overrides": set_overrides(grid, seed),
                                  "out": str(folder)}})
    if answer["code"] != 0:
        raise RunFailed(f"sampling the offline set of seed {seed} failed (exit {answer['code']}); log: {log}")
    meta = {**answer["result"], "key": key, "shortened": grid.shortened, "task_wall_s": time.perf_counter() - start}
    if "task_cpu_s" not in meta and answer.get("cpu_s") is not None:
        meta["task_cpu_s"] = answer["cpu_s"]
    return folder / "rollouts", meta


# ------------------------------------------------------------------------------------------------ one cell
def times_of(run: Run) -> dict:
    """A run's wall-clock and CPU seconds split by the pack's own timers: the rollout phase (sampling, scoring
    and, for plain GRPO, the behaviour policy's log-probs; an offline arm's replay of its set), the updates
    without it, and the rest (loading, held-out evaluations, saving)."""
    summary = run.summary
    steps_wall = sum(float(m.get("step_time_s", 0.0)) for m in run.metrics)
    rollout_wall = float(summary.get("rollout_s", 0.0))
    out = {"wall_s": run.wall_s, "cpu_s": run.cpu_s, "rollout_wall_s": rollout_wall,
           "update_wall_s": steps_wall - rollout_wall, "other_wall_s": run.wall_s - steps_wall}
    if "step_cpu_s" in summary:
        out.update(rollout_cpu_s=summary["rollout_cpu_s"],
                   update_cpu_s=summary["step_cpu_s"] - summary["rollout_cpu_s"])
        if run.cpu_s is not None:
            out["other_cpu_s"] = run.cpu_s - summary["step_cpu_s"]
    return out


def greedy(run: Run, pool: WorkerPool) -> dict:
    """The greedy held-out answers of the run's merged model (all held-out problems), then the merged weights go."""
    from eval.addition import problems

    merged = run.output_dir / "final" / "merged"
    log = run.output_dir / "greedy.log"
    start = time.perf_counter()
    answer = pool.ask({"call": "eval.addition:greedy_accuracy", "log": str(log),
                       "kwargs": {"model_dir": str(merged), "rows": problems()["eval"]}})
    if answer["code"] != 0:
        raise RunFailed(f"the greedy evaluation of {run.arm} seed {run.seed} failed; log: {log}")
    shutil.rmtree(merged, ignore_errors=True)  # 0.5 GB each; the adapter stays in final/
    result = answer["result"]
    return {"greedy_right_sum": result["right_sum"], "greedy_right": result["right"], "greedy_n": result["n"],
            "greedy_answers": result["answers"], "greedy_wall_s": time.perf_counter() - start,
            "greedy_cpu_s": answer.get("cpu_s")}


def record(run: Run, arm: RealArm, key: str, grid: RealGrid, set_meta: Optional[dict], greedy_result: dict) -> dict:
    """A finished cell's entry in ``results.json``."""
    steps, values = run.curve
    metrics = run.metrics
    entry = {"arm": arm.name, "seed": run.seed, "key": key, "shortened": grid.shortened,
             "held_out_start": values[0], "held_out_end": values[-1], "steps": steps, "held_out": values,
             "win_rate": run.win_rate, **{k: greedy_result[k] for k in ("greedy_right_sum", "greedy_right",
                                                                         "greedy_n")},
             **times_of(run), "greedy_wall_s": greedy_result["greedy_wall_s"],
             "greedy_cpu_s": greedy_result["greedy_cpu_s"],
             "losses": [m.get("loss") for m in metrics], "train_reward": [m.get("reward_mean") for m in metrics],
             "ratio_mean": [m.get("ratio/mean") for m in metrics],
             "ppo_clip_frac": [m.get("clip/frac") for m in metrics],
             "unclamped_frac": [m.get("unclamped_frac") for m in metrics],
             "rollout_updates": [m["step"] for m in metrics if m.get("rollout")],
             "torch_threads": run.summary.get("torch_threads"), "deterministic": run.summary.get("deterministic"),
             "recipe": str(arm.recipe.relative_to(REPO)), "overrides": [o for o in run.overrides
                                                                       if not o.startswith("rollout.replay=")],
             "greedy_answers": greedy_result["greedy_answers"]}
    if set_meta is not None:
        entry["offline_set"] = set_meta["key"]
    samples = run.output_dir / "rollouts" / "rank00000.jsonl"
    if samples.exists():  # online arms: what each update sampled (the check against the offline set)
        entry["sampled"] = [[r["train_step"], r["position"], r["prompt"][-1]["content"],
                             hashlib.sha256(json.dumps([r["completion_ids"], r["scores"]]).encode()).hexdigest()[:16]]
                            for r in read_jsonl(samples)]
    return entry


def set_digests(rollouts: Path) -> List[list]:
    """The offline set's (update, position, prompt, digest of its ids and scores), as ``record``'s ``sampled``."""
    return [[r["train_step"], r["position"], r["prompt"][-1]["content"],
             hashlib.sha256(json.dumps([r["completion_ids"], r["scores"]]).encode()).hexdigest()[:16]]
            for path in sorted(rollouts.glob("rank*.jsonl")) for r in read_jsonl(path)]


def run_cell(arm: RealArm, seed: int, grid: RealGrid, cache: Path, pool: WorkerPool,
             sets: Dict[int, Tuple[Path, dict]]) -> dict:
    """Train one cell through ``launchers/run.py`` in a worker, then its greedy answers; returns its record."""
    key = cell_key(arm, grid, seed)
    overrides = cell_overrides(arm, grid, seed)
    set_meta = None
    if arm.offline:
        rollouts, set_meta = sets[seed]
        overrides.append(f"rollout.replay={rollouts}")
    run = Run(arm.name, seed, arm.recipe, overrides, cache / "cells" / arm.name / f"seed{seed}-{key}")
    run = run_all([run], pool, f"{arm.name} seed {seed}")[0]
    return record(run, arm, key, grid, set_meta, greedy(run, pool))


# ------------------------------------------------------------------------------------------------ the study
def parse_arms(args) -> Tuple[Optional[List[RealArm]], str]:
    names = args.arms or [a.name for a in ARMS]
    unknown = [n for n in names if n not in ARM]
    if unknown:
        return None, (f"error: unknown arm(s) {', '.join(unknown)} in the real study; arms: {', '.join(ARM)}")
    if args.warmups or args.sweep or args.regimes:
        return None, "error: the real study has no warm-ups, sweep or regimes (--arms, --seeds, --out, --plan, --quick)"
    return [ARM[n] for n in names], ""


def run_real(args, grid, out: Path, cache: Path, pool: WorkerPool) -> int:
    """Plan, then every pending cell (offline sets first where a seed's offline arm needs one), the report after
    each."""
    from .real_report import write_report

    arms, error = parse_arms(args)
    if arms is None:
        print(error, file=sys.stderr)
        return 2
    real = QUICK_REAL if grid.shortened else FULL_REAL
    seeds = list(range(args.seeds or 3))
    cells = plan_cells(arms, seeds)
    results = load_results(out)
    done = {(r["arm"], r["seed"]): r for r in results["runs"]}
    todo = pending(cells, done, real)
    known_sets = {s["seed"]: s for s in results["offline_sets"] if s.get("key") == set_key(real, s["seed"])}
    real_cache = cache / ("real-quick" if real.shortened else "real")
    to_sample = sorted({s for a, s in todo
                        if a.offline and not (set_folder(real_cache, real, s) / "set.json").exists()})
    text, eta = plan_text(cells, todo, to_sample, real, results, pool.jobs)
    print(text, flush=True)
    if args.plan:
        return 0
    meta = {"title": TITLE, "design": design(real, arms, seeds), "plan_eta_s": eta}
    env = environment(pool) if todo else results.get("environment", {})
    start = time.perf_counter()
    sets: Dict[int, Tuple[Path, dict]] = {}
    for arm, seed in todo:
        if arm.offline and seed not in sets:
            sets[seed] = offline_set(real, seed, real_cache, pool)
            set_check(known_sets.get(seed), sets[seed][1])
            known_sets[seed] = {**sets[seed][1], "digests": set_digests(sets[seed][0])}
        entry = run_cell(arm, seed, real, real_cache, pool, sets)
        done[(arm.name, seed)] = {**entry, "git_commit": env.get("git_commit")}
        results = {**meta, "environment": env, "offline_sets": sorted(known_sets.values(), key=lambda s: s["seed"]),
                   "runs": [done[k] for k in sorted(done, key=lambda k: (ARMS.index(ARM[k[0]]), k[1]))],
                   "sitting_wall_s": time.perf_counter() - start}
        write_report(out, results, LABELS)
    if not todo:
        print("every planned cell is finished; nothing to run")
    return 0


def set_check(recorded: Optional[dict], sampled: dict) -> None:
    """A set sampled again must be the recorded one to the byte (the runs are deterministic)."""
    if recorded is not None and recorded.get("sha256") != sampled["sha256"]:
        raise RunFailed(f"the offline set of seed {sampled['seed']} was sampled again and differs from the one in "
                        f"results.json (sha256 {sampled['sha256']} vs {recorded.get('sha256')}): the runs are not "
                        "reproducible here (other kernels or versions?)")


def design(grid: RealGrid, arms: Sequence[RealArm], seeds: Sequence[int]) -> dict:
    """What every cell shares, for the report."""
    return {"updates": grid.steps, "shortened": grid.shortened, "grid_overrides": list(grid.overrides),
            "common_overrides": list(COMMON), "arms": {a.name: {"recipe": str(a.recipe.relative_to(REPO)),
                                                                 "label": a.label, "offline": a.offline}
                                                        for a in arms},
            "seeds": list(seeds)}


TITLE = "Offline, offline + humanline and online GRPO on SmolLM2-135M-Instruct (two-digit additions)"

# the arms by name for the command line's --arms check (the runner reads `ARMS`)
REAL = Study(name="real", title=TITLE, metric="held-out reward",
             arms=tuple(Arm(a.name, str(a.recipe), a.label, "data" if a.offline else "online") for a in ARMS),
             quick_arms=(), quick_extra=(), repeat_arm="", runner=run_real, jobs=1,
             cache=REPO / "runs" / "repro" / "cache")
