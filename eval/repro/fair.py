"""The fair preference study (``python -m eval.repro --study preference_fair``): before the preference study's
reading (offline humanline closes none of the offline-online gap for DPO and KTO) stands, humanline gets the
paper's allowance, and every other arm gets the same. Same task, warm-ups (and their acceptance rule), regime and
statistics as ``--study preference``; DPO and KTO (offline humanline GRPO already closed 59% of its gap there).

1. **Equal tuning budget.** Every arm tunes its own learning rate on tuning runs (RL seeds ``tuning_seeds``, never
   reported, on the first ``tuning_warmups`` accepted warm-ups): online over ``online_lrs`` (the multipliers x the
   preference recipes' 1e-4), offline humanline (k = 1, clip +-1.5) and offline over the multipliers x online's
   choice. Then each arm, at its chosen learning rate, tries the other max grad norms: the authors ran online
   DPO/KTO at 0.5 and made humanline's a launch argument (``docs/authors-settings.md``); offline gets the same
   try, so every arm has the same number of tuning points. The rule is `select`, fixed before any run.
2. **Sync period**: humanline at k in ``sync_periods``, at humanline's tuned values (tuned at k = 1).
3. **Offline data source** (``eval.repro.sources``): offline and offline humanline at their tuned values (tuned
   on the weak source) on each source; online writes its own data and is the reference for every source.
4. **Clamp**: the fraction of tokens the clamp changed, per arm; humanline at the paper's other bounds.

Every reported arm runs on every accepted warm-up x RL seeds 0..n-1 (the preference study's design), at its tuned
values and, for offline and humanline, at online's. Writes ``results.{json,md}`` and ``curves.png`` under
``--out``; the full grid also writes ``docs/repro/preference_fair.{json,md,png}``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from hl_core.storage.digests import sha256_file

from .fair_report import write_fair_report
from .runs import REPO, Run, WorkerPool, accepted_warmups, environment, policy_warmup, run_all, warmup_dir
from .sources import QUICK_SOURCES, SOURCES, source_data, train_writers
from .stats import curve_auc
from .studies import Arm, Study, grid_runs, same_seed_checks

OBJECTIVES_LABEL = {"dpo": "DPO", "kto": "KTO"}
BASE_LR = 1e-4  # the preference recipes' learning rate (chosen by the preference sweep's online arms)
DEFAULT_BOUNDS = (-1.5, 1.5)
RECIPE = {"online": "{o}_online.yaml", "offline": "{o}_offline.yaml", "humanline": "{o}_offline_humanline.yaml"}
KIND_LABEL = {"online": "online", "offline": "offline", "humanline": "offline humanline"}
DOCS = REPO / "docs" / "repro" / "preference_fair"
ESTIMATES = REPO / "docs" / "repro" / "preference.json"  # per-run times the ETA starts from
STARTUP_S = 8.0  # a fresh process's start-up in those times, which a reused worker does not pay
QUICK_RUN_S = 5.0  # a shortened-grid run in a warm worker, idle 2-core machine
WARMUP_S_PER_STEP = {False: 0.30, True: 0.12}  # supervised warm-up seconds per update (full batch 128, quick 64)
RULE = ("the candidate with the largest mean held-out reward AUC over its tuning runs (every candidate of an arm "
        "ran on the same warm-ups and tuning seeds); a tie goes to the earlier candidate in the grid's order")


def _lr(value: float) -> float:
    return float(f"{value:.3g}")


@dataclass(frozen=True)
class FairGrid:
    objectives: Tuple[str, ...]
    multipliers: Tuple[float, ...]  # online: x BASE_LR; humanline and offline: x online's choice
    norms: Tuple[float, ...]  # max grad norm: the first is the recipes' (lr tuned at it), the rest tried after
    tuning_warmups: int  # tuning runs use the first n accepted warm-ups ...
    tuning_seeds: Tuple[int, ...]  # ... with these RL seeds (disjoint from the reported seeds)
    sync_periods: Tuple[int, ...]  # humanline k at its tuned values (k = 1 is the tuned arm itself)
    bounds: Tuple[Tuple[float, float], ...]  # other clamp bounds for humanline at its tuned values
    sources: Tuple[str, ...]  # the first is the tuning source

    @property
    def online_lrs(self) -> Tuple[float, ...]:
        return tuple(_lr(BASE_LR * m) for m in self.multipliers)


# tuning on 1 warm-up x 1 seed keeps the full study under 60 min on 2 cores (its runs measured 0.9-1.8x the
# estimates in CPU seconds on a loaded machine); every arm gets the same tuning runs, so the noise is shared
FULL_FAIR = FairGrid(("dpo", "kto"), (0.1, 0.3, 1.0, 2.0, 4.0), (1.0, 0.5), 1, (100,), (1, 4, 16),
                     ((-1.0, 1.5), (-0.1, 1.0)), ("weak", "strong", "mixture"))
QUICK_FAIR = FairGrid(("dpo",), (1.0, 4.0), (1.0, 0.5), 1, (100,), (1, 4), ((-0.1, 1.0),),
                      ("weak", "strong", "mixture"))


@dataclass(frozen=True)
class Setting:
    """One arm's values: objective, kind (online | offline | humanline), learning rate, max grad norm, humanline's
    sync period and clamp bounds, and the offline data source."""

    objective: str
    kind: str
    lr: float
    norm: float = 1.0
    k: int = 1
    bounds: Tuple[float, float] = DEFAULT_BOUNDS
    source: str = "weak"

    @property
    def name(self) -> str:
        parts = [f"{self.objective}_{self.kind}"]
        if self.kind == "humanline" and self.k != 1:
            parts.append(f"k{self.k}")
        if self.kind == "humanline" and self.bounds != DEFAULT_BOUNDS:
            parts.append(f"clip{self.bounds[0]:g}_{self.bounds[1]:g}")
        if self.kind != "online" and self.source != "weak":
            parts.append(self.source)
        return "_".join(parts) + f"@lr{self.lr:g}" + ("" if self.norm == 1.0 else f",norm{self.norm:g}")

    @property
    def label(self) -> str:
        extra = [f"k={self.k}", f"clip [{self.bounds[0]:g}, {self.bounds[1]:g}]"] if self.kind == "humanline" else []
        extra += [] if self.kind == "online" else [f"{self.source} data"]
        extra += [f"lr {self.lr:g}"] + ([] if self.norm == 1.0 else [f"max grad norm {self.norm:g}"])
        return f"{KIND_LABEL[self.kind]} {OBJECTIVES_LABEL[self.objective]} ({', '.join(extra)})"

    def arm(self, reference: str = "") -> Arm:
        overrides = [f"train.lr={self.lr:g}", f"train.max_grad_norm={self.norm:g}"]
        if self.kind == "humanline":
            overrides += [f"humanline.sync_every={self.k}", f"humanline.log_eps_P={self.bounds[0]:g}",
                          f"humanline.log_eps_R={self.bounds[1]:g}"]
        online = self.kind == "online"
        return Arm(self.name, "preference/" + RECIPE[self.kind].format(o=self.objective), self.label,
                   "online" if online else "data", tuple(overrides), data=None if online else f"{self.source}:pairs",
                   reference=reference, batch_scale=2 if self.objective == "kto" and not online else 1)


def select(candidates: Sequence[Setting], auc: Dict[Setting, List[float]]) -> Setting:
    """The tuning rule, fixed before any run: see ``RULE``."""
    best = candidates[0]
    for candidate in candidates[1:]:
        if statistics.fmean(auc[candidate]) > statistics.fmean(auc[best]):
            best = candidate
    return best


def roles(fg: FairGrid, objective: str, chosen: Dict[Tuple[str, str], Setting]) -> Dict[str, Setting]:
    """The reported arms of one objective by role (several roles may name one setting)."""
    online, offline, humanline = (chosen[(objective, kind)] for kind in ("online", "offline", "humanline"))
    at_online = {"lr": online.lr, "norm": online.norm}
    out = {"online": online, "offline": offline, "offline@online": replace(offline, **at_online),
           "humanline": humanline, "humanline@online": replace(humanline, **at_online)}
    out.update({f"humanline k={k}": replace(humanline, k=k) for k in fg.sync_periods if k != 1})
    for source in fg.sources[1:]:
        out[f"offline {source}"] = replace(offline, source=source)
        out[f"humanline {source}"] = replace(humanline, source=source)
    out.update({f"humanline clip {lo:g}/{hi:g}": replace(humanline, bounds=(lo, hi)) for lo, hi in fg.bounds})
    return out


def tuning_points(fg: FairGrid) -> int:
    """Tuning settings per objective: online's learning rates and norms, and the same count for each other arm."""
    per_arm = len(fg.multipliers) + len(fg.norms) - 1
    return 3 * per_arm


def reported_roles(fg: FairGrid) -> int:
    return 5 + len([k for k in fg.sync_periods if k != 1]) + 2 * (len(fg.sources) - 1) + len(fg.bounds)


def estimate_s(setting: Setting, quick: bool, table: Dict[str, float]) -> float:
    """A run's expected seconds in a warm worker: its kind's mean in ``docs/repro/preference.json`` less a fresh
    process's start-up (``QUICK_RUN_S`` in the shortened grid)."""
    if quick:
        return QUICK_RUN_S
    base = f"{setting.objective}_{'offline_humanline' if setting.kind == 'humanline' else setting.kind}"
    return max(table.get(base, 30.0) - STARTUP_S, 1.0)


def measured_times() -> Dict[str, float]:
    runs = json.loads(ESTIMATES.read_text())["runs"] if ESTIMATES.exists() else []
    by_arm: Dict[str, List[float]] = {}
    for run in runs:
        by_arm.setdefault(run["arm"], []).append(float(run["wall_s"]))
    return {arm: statistics.fmean(v) for arm, v in by_arm.items()}


class Context:
    """What the stages share: the grids, the warm-ups, the data, the pool, the progress bar and every run so far."""

    def __init__(self, fg: FairGrid, grid, models: Dict[int, Path], seeds: Sequence[int], data: Dict[str, Path],
                 out: Path, pool: WorkerPool, bar):
        self.fg, self.grid, self.models, self.seeds, self.data, self.out, self.pool, self.bar = \
            fg, grid, models, list(seeds), data, out, pool, bar
        self.tuning_models = {w: models[w] for w in sorted(models)[:fg.tuning_warmups]}
        self.times = measured_times()
        self.tuning: Dict[Setting, List[Run]] = {}
        self.stage_s: Dict[str, float] = {}

    def execute(self, settings: Sequence[Setting], models: Dict[int, Path], seeds: Sequence[int], folder: str,
                references: Dict[Setting, str], stage: str, tag: str = "") -> Dict[Setting, List[Run]]:
        start = time.perf_counter()
        runs: List[Run] = []
        for setting in settings:
            for run in grid_runs([setting.arm(references.get(setting, ""))], self.grid, models, self.out, seeds,
                                 tag=tag, data=self.data, folder=folder):
                run.estimate_s = estimate_s(setting, self.grid.shortened, self.times)
                runs.append(run)
        done = run_all(runs, self.pool, stage, bar=self.bar)
        self.stage_s[stage] = self.stage_s.get(stage, 0.0) + time.perf_counter() - start
        return {s: [r for r in done if r.arm == s.name + tag] for s in settings}

    def tune(self, groups: Dict[Tuple[str, str, str], List[Setting]],
             stage: str) -> Dict[Tuple[str, str, str], Setting]:
        """Run every candidate not yet run on the tuning runs; the rule's choice per group."""
        todo = list(dict.fromkeys(s for c in groups.values() for s in c if s not in self.tuning))
        self.tuning.update(self.execute(todo, self.tuning_models, self.fg.tuning_seeds, "tuning", {}, stage))
        auc = {s: [curve_auc(*r.curve) for r in runs] for s, runs in self.tuning.items()}
        return {key: select(candidates, auc) for key, candidates in groups.items()}


def tune_all(ctx: Context) -> Tuple[Dict[Tuple[str, str], Setting], List[dict]]:
    """Stages 1-3: online's learning rate; online's norm with humanline's and offline's learning rates (x online's
    choice); humanline's and offline's norms. Returns the choices and the tuning table."""
    fg, groups = ctx.fg, {}
    first = ctx.tune({(o, "online", "lr"): [Setting(o, "online", lr) for lr in fg.online_lrs] for o in fg.objectives},
                     "tuning 1/3: online learning rate")
    groups.update({key: [Setting(key[0], "online", lr) for lr in fg.online_lrs] for key in first})
    second_groups = {}
    for o in fg.objectives:
        online = first[(o, "online", "lr")]
        second_groups[(o, "online", "max_grad_norm")] = [replace(online, norm=n) for n in fg.norms]
        for kind in ("humanline", "offline"):
            second_groups[(o, kind, "lr")] = [Setting(o, kind, _lr(online.lr * m)) for m in fg.multipliers]
    second = ctx.tune(second_groups, "tuning 2/3: online max grad norm, humanline and offline learning rates")
    groups.update(second_groups)
    third_groups = {(o, kind, "max_grad_norm"): [replace(second[(o, kind, "lr")], norm=n) for n in fg.norms]
                    for o in fg.objectives for kind in ("humanline", "offline")}
    third = ctx.tune(third_groups, "tuning 3/3: humanline and offline max grad norm")
    groups.update(third_groups)
    choices = {**first, **second, **third}
    chosen = {(o, kind): choices[(o, kind, "max_grad_norm")] for o in fg.objectives
              for kind in ("online", "humanline", "offline")}
    table = [{"objective": o, "arm": kind, "knob": knob, "chosen": choices[(o, kind, knob)].name,
              "candidates": [{"arm": s.name, "lr": s.lr, "max_grad_norm": s.norm,
                              "auc_runs": [curve_auc(*r.curve) for r in ctx.tuning[s]],
                              "auc_mean": statistics.fmean(curve_auc(*r.curve) for r in ctx.tuning[s]),
                              "wall_s": sum(r.wall_s for r in ctx.tuning[s])} for s in candidates]}
             for (o, kind, knob), candidates in groups.items()]
    return chosen, table


def plan_text(fg: FairGrid, grid, n_warmups: int, seeds: Sequence[int], jobs: int, cache: Path) -> Tuple[str, dict]:
    """The planned run count and an ETA, printed before anything runs."""
    times = measured_times()
    tuning_runs = len(fg.objectives) * tuning_points(fg) * fg.tuning_warmups * len(fg.tuning_seeds)
    reported = len(fg.objectives) * reported_roles(fg) * n_warmups * len(seeds) + (1 if grid.shortened else 0)
    per_kind = {o: {k: estimate_s(Setting(o, k, BASE_LR), grid.shortened, times) for k in RECIPE}
                for o in fg.objectives}
    tuning_s = sum(fg.tuning_warmups * len(fg.tuning_seeds) * sum(per_kind[o].values()) * (tuning_points(fg) // 3)
                   for o in fg.objectives)
    # every reported role at its kind's time (a role whose values equal another's runs once: "at most")
    placeholder = {(o, kind): Setting(o, kind, BASE_LR) for o in fg.objectives for kind in RECIPE}
    reported_s = sum(per_kind[o][setting.kind] for o in fg.objectives
                     for setting in roles(fg, o, placeholder).values()) * n_warmups * len(seeds)
    sources = QUICK_SOURCES if grid.shortened else SOURCES
    writers = {(w.name, w.seed, w.overrides) for s in fg.sources for w in sources[s].writers}
    untrained = [w for w in writers if not (warmup_dir(cache, [*grid.warmup_overrides, *w[2]], w[1], w[0])
                                            / "final" / "config.json").exists()]
    writer_steps = [int(o.split("=")[1]) for w in untrained for o in w[2] if o.startswith("train.max_steps=")]
    # the policy warm-ups (seeds 0..n-1; a rejected seed draws another, not counted here), then the writers side by
    # side: each stage lasts its longest warm-up or its total over the jobs, whichever is longer
    policy_overrides, policy_steps = policy_warmup(grid)
    policies = [s for s in range(n_warmups)
                if not (warmup_dir(cache, policy_overrides, s) / "final" / "config.json").exists()]
    stages = [[policy_steps] * len(policies), writer_steps]
    warmup_eta = sum(max(max(st, default=0), sum(st) / jobs) for st in stages) * WARMUP_S_PER_STEP[grid.shortened]
    eta = (tuning_s + reported_s) / jobs + warmup_eta
    plan = {"tuning_runs": tuning_runs, "reported_runs_at_most": reported, "writers_to_train": len(untrained),
            "policy_warmups_to_train": len(policies), "eta_s": eta, "warmup_eta_s": warmup_eta}
    text = (f"plan: {tuning_runs + reported} runs at most ({tuning_runs} tuning on {fg.tuning_warmups} warm-up(s) x "
            f"seeds {list(fg.tuning_seeds)}, {reported} reported on {n_warmups} warm-ups x seeds {list(seeds)}), "
            f"{jobs} at a time; {len(policies)} policy warm-up(s) and {len(untrained)} data writer(s) to train first "
            f"({plan['warmup_eta_s'] / 60:.1f} min of the ETA); ETA {eta / 60:.1f} min (runs from {ESTIMATES.name}'s "
            f"per-run times less {STARTUP_S:.0f} s start-up each)")
    return text, plan


def fair_checks(runs: Sequence[Run], repeat, data: Dict[str, Path], metas: Dict[str, dict]) -> dict:
    """Online arms sample at every update, offline arms never generate, the data read is the data written, and
    (shortened grid) one seed gives one curve."""
    online = [m for r in runs if "_online@" in r.arm for m in r.metrics]
    offline = [m for r in runs if "_online@" not in r.arm for m in r.metrics]
    checks = {"online_rollout_every_update": bool(online) and all(m.get("rollout") is True for m in online),
              "offline_never_generates": bool(offline) and all("rollout" not in m for m in offline),
              "offline_data_unchanged": all(sha256_file(data[f"{s}:{k}"]) == metas[s]["sha256"][k]
                                            for s in metas for k in ("pairs", "groups"))}
    if repeat is not None:
        checks.update(same_seed_checks({(r.arm, r.warmup, r.seed): r for r in runs}, repeat))
    return checks


def run_fair(args, grid, out: Path, cache: Path, pool: WorkerPool) -> int:
    """The whole study: plan and ETA, warm-ups, data, the three tuning stages, the reported runs, the report."""
    from tqdm import tqdm  # the progress bar: only a running study needs it

    fg = QUICK_FAIR if grid.shortened else FULL_FAIR
    seeds = list(range(args.seeds or grid.seeds))
    if args.sweep or set(seeds) & set(fg.tuning_seeds):
        print(f"error: the {args.study} study takes no --sweep, and its reported RL seeds {seeds} must stay apart from "
              f"its tuning seeds {list(fg.tuning_seeds)} (use --seeds {min(fg.tuning_seeds)} or fewer)",
              file=sys.stderr)
        return 2
    n_warmups = args.warmups or grid.warmups
    start = time.perf_counter()
    text, plan = plan_text(fg, grid, n_warmups, seeds, pool.jobs, cache)
    print(text, flush=True)
    if args.plan:
        return 0
    models, warmup_table = accepted_warmups(cache, grid, n_warmups, pool)
    sources = QUICK_SOURCES if grid.shortened else SOURCES
    train_writers([sources[name] for name in fg.sources], cache, grid.warmup_overrides, pool)
    data: Dict[str, Path] = {}
    metas: Dict[str, dict] = {}
    for name in fg.sources:
        paths = source_data(sources[name], cache, grid.warmup_overrides, pool, limit=256 if grid.shortened else None)
        data.update({f"{name}:{k}": paths[k] for k in ("pairs", "groups")})
        metas[name] = json.loads(paths["meta"].read_text())
    total = plan["tuning_runs"] + plan["reported_runs_at_most"]
    with tqdm(total=total, desc="preference_fair", unit="run") as bar:
        ctx = Context(fg, grid, models, seeds, data, out, pool, bar)
        chosen, tuning_table = tune_all(ctx)
        by_role = {o: roles(fg, o, chosen) for o in fg.objectives}
        settings = list(dict.fromkeys(s for r in by_role.values() for s in r.values()))
        refs = {s: by_role[s.objective]["online"].name for s in settings if s.kind != "online"}
        bar.total = plan["tuning_runs"] + len(settings) * len(models) * len(seeds) + (1 if grid.shortened else 0)
        reported = ctx.execute(settings, models, seeds, "runs", refs, "reported arms")
        repeat = None
        if grid.shortened:  # one humanline DPO run again: the same curve and losses
            again = by_role[fg.objectives[0]]["humanline"]
            first = sorted(models)[0]
            repeat = ctx.execute([again], {first: models[first]}, seeds[:1], "runs", {}, "repeat", "_repeat")[again][0]
    runs = [r for s in settings for r in reported[s]]
    meta = {"mode": "quick" if grid.shortened else "study", "design": {**asdict(fg), "online_lrs": fg.online_lrs,
            "rule": RULE, "reported_seeds": seeds, "tuning_warmups": sorted(ctx.tuning_models)}, "plan": plan,
            "warmups": sorted(models), "warmup_acceptance": warmup_table, "seeds": seeds, "sources": metas,
            "environment": environment(pool), "stage_wall_s": ctx.stage_s, "wall_s": time.perf_counter() - start}
    checks = fair_checks(runs + ([repeat] if repeat else []), repeat, data, metas)
    write_fair_report(out, PREFERENCE_FAIR.title, fg.sync_periods, runs, ctx.tuning, tuning_table, chosen, by_role,
                      meta, checks)
    if not grid.shortened:
        for suffix, name in ((".json", "results.json"), (".md", "results.md"), (".png", "curves.png")):
            shutil.copyfile(out / name, DOCS.with_suffix(suffix))
        print(f"wrote {DOCS}.{{json,md,png}}")
    return 0


PREFERENCE_FAIR = Study(
    name="preference_fair", title="Does humanline close the gap once it gets the paper's allowance? (toy preference "
    "task, DPO / KTO)", metric="held-out reward", arms=(), quick_arms=(), quick_extra=(), repeat_arm="",
    runner=run_fair)
