"""The studies the driver runs: their arms (recipe + schedule), the shortened grid, the sweep and the built-in
sanity checks. ``grpo``: does humanline close the gap between sparse/offline and online GRPO on a verifiable
task (``recipes/repro/``)? ``preference``: the paper's offline-vs-online experiment for DPO, KTO and GRPO
(``recipes/repro/preference/``, offline data from a weaker model: ``eval/repro/preference.py``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .runs import Run

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes" / "repro"


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: str  # under recipes/repro/
    label: str
    # how `rollout.every` scales in a shortened grid: online (1) | sparse | offline (all samples at update 0) |
    # data (offline data from a file: no rollouts)
    schedule: str
    overrides: Tuple[str, ...] = ()
    data: Optional[str] = None  # offline data file the arm trains on ("pairs" | "groups"), built by the study
    reference: str = "online"  # the arm its verdicts are against
    batch_scale: int = 1  # examples per prompt in `train.micro_batch_size` (KTO from pairs: 2)


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
    warmups: int = 3  # warm-up models, each crossed with every RL seed
    seeds: int = 2  # RL seeds per warm-up
    # a warm-up is a valid start only if one sampled answer per held-out problem is right this often at its end
    # (fixed before any RL run: seed 2 of the first crossed study ended at 3-4%, seeds 0 and 1 at 27-29%);
    # seeds are drawn in order 0, 1, 2, ... until `warmups` pass
    warmup_min_accuracy: float = 0.15

    def overrides(self, arm: Arm) -> List[str]:
        if not self.shortened:
            return list(arm.overrides)
        every = {"online": [1], "sparse": [self.sparse_every], "offline": [self.steps], "data": []}[arm.schedule]
        return [f"train.max_steps={self.steps}", f"train.micro_batch_size={self.prompts_per_update * arm.batch_scale}",
                f"eval.every={self.eval_every}", f"data.eval.limit={self.eval_prompts}", *arm.overrides,
                *(f"rollout.every={e}" for e in every)]


FULL = Grid()
# the quick warm-up: half the batch, two thirds of the updates (~45 s on an idle core; its loss drops past ~350
# updates, so fewer would not learn the task)
QUICK = Grid(shortened=True, steps=8, sparse_every=4, prompts_per_update=4, eval_every=4, eval_prompts=64,
             warmup_overrides=("train.micro_batch_size=64", "train.max_steps=400"), warmups=2, seeds=1,
             warmup_min_accuracy=0.05)


def grid_runs(arms: Sequence[Arm], grid: Grid, models: Dict[int, Path], out: Path, seeds: Sequence[int],
              extra: Sequence[str] = (), tag: str = "", data: Optional[Dict[str, Path]] = None,
              folder: str = "runs") -> List[Run]:
    """Every arm x warm-up model x RL seed (the same RL seeds under each warm-up: a crossed design), each under
    ``out/folder/<arm><tag>/warmup<w>-seed<s>``."""
    runs = []
    for arm in arms:
        data_override = [f"data.train.path={(data or {})[arm.data]}"] if arm.data else []
        for w, model in models.items():
            for seed in seeds:
                runs.append(Run(arm.name + tag, seed, RECIPES / arm.recipe,
                                grid.overrides(arm) + data_override + [f"model.name_or_path={model}",
                                                                       f"train.seed={seed}", *extra],
                                out / folder / (arm.name + tag) / f"warmup{w}-seed{seed}", warmup=w))
    return runs


@dataclass(frozen=True)
class Study:
    name: str
    title: str
    metric: str  # what the held-out curve measures
    arms: Tuple[Arm, ...]
    quick_arms: Tuple[str, ...]
    quick_extra: Tuple[Arm, ...]  # arms only the quick grid runs (sanity checks)
    repeat_arm: str  # the quick grid runs it twice with one seed: same curve, same losses
    # the sweep: regime name -> (overrides, arms run under it); the regime is chosen by `choose_by` arms alone
    regimes: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = field(default_factory=dict)
    choose_by: Tuple[str, ...] = ("online",)
    checks: Optional[Callable] = None  # (runs, repeat) -> dict of sanity checks
    # a study with stages of its own: (args, grid, out, cache, pool) -> exit code (instead of the arms x seeds grid)
    runner: Optional[Callable] = None
    jobs: Optional[int] = None  # runs at a time unless --jobs says (None: the CPU count)
    # where its runs, caches and worker logs go unless --cache says, whatever --out is (None: beside --out), so
    # that --out may be a docs folder that receives only the results
    cache: Optional[Path] = None

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms + self.quick_extra if a.name == name)


# ------------------------------------------------------------------------------------------------ grpo
GRPO_ARMS: Tuple[Arm, ...] = (
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
_ONLINE, _K16 = ("online",), ("online", "humanline_sparse_k16")


def _clamp(low: float, high: float) -> Tuple[str, ...]:
    return ("train.lr=1e-4", f"humanline.log_eps_P={low}", f"humanline.log_eps_R={high}")


GRPO_REGIMES: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    # one factor at a time around lr 3e-4 (the first sweep), online arm only ...
    "lr3e-4": (("train.lr=3e-4",), _ONLINE),
    "lr1e-4": (("train.lr=1e-4",), _K16),
    "lr3e-5": (("train.lr=3e-5",), _ONLINE),
    "lr1e-6": (("train.lr=1e-6",), _ONLINE),
    "lr3e-4_kl1e-4": (("train.lr=3e-4", "objective.beta_kl=1e-4"), _ONLINE),
    "lr3e-4_T0.7": (("train.lr=3e-4", "rollout.temperature=0.7"), _ONLINE),
    # ... and the crossings at the study's lr 1e-4, online and humanline k=16
    "lr1e-4_kl1e-4": (("train.lr=1e-4", "objective.beta_kl=1e-4"), _K16),
    "lr1e-4_T0.7": (("train.lr=1e-4", "rollout.temperature=0.7"), _K16),
    # the clamp pairs on humanline sparse k=16 at lr 1e-4 (reported, never used to choose the regime)
    "lr1e-4_clamp-0.1/1.0": (_clamp(-0.1, 1.0), ("humanline_sparse_k16",)),
    "lr1e-4_clamp-0.1/0.5": (_clamp(-0.1, 0.5), ("humanline_sparse_k16",)),
}


def grpo_checks(runs, repeat) -> dict:
    """Online ratio exactly 1; humanline k=1 with fresh samples tracks online; one seed gives one curve."""
    by = {(r.arm, r.warmup, r.seed): r for r in runs}
    checks: dict = {}
    ratios = [m.get("ratio/mean") for r in runs if r.arm == "online" for m in r.metrics]
    checks["online_ratio_exactly_one"] = bool(ratios) and all(v == 1.0 for v in ratios)
    pairs = [(by[("online", r.warmup, r.seed)], r) for r in runs
             if r.arm == HUMANLINE_ONLINE.name and ("online", r.warmup, r.seed) in by]
    if pairs:
        first = [(a.metrics[0]["loss"], b.metrics[0]["loss"]) for a, b in pairs]
        gaps = [abs(x - y) for a, b in pairs for x, y in zip(a.curve[1], b.curve[1])]
        checks["humanline_k1_online_first_update_loss_equal"] = all(x == y for x, y in first)
        checks["humanline_k1_online_max_curve_gap"] = max(gaps)
        checks["humanline_k1_online_mean_curve_gap"] = sum(gaps) / len(gaps)
    checks.update(same_seed_checks(by, repeat))
    return checks


def same_seed_checks(by: dict, repeat) -> dict:
    if repeat is None:
        return {}
    original = by[(repeat.arm.removesuffix("_repeat"), repeat.warmup, repeat.seed)]
    return {"same_seed_same_curve": repeat.curve == original.curve,
            "same_seed_same_losses": [m["loss"] for m in repeat.metrics] == [m["loss"] for m in original.metrics]}


GRPO = Study(
    name="grpo", title="Does humanline close the gap? (toy addition, GRPO)", metric="held-out accuracy",
    arms=GRPO_ARMS, quick_arms=("online", "sparse", "humanline_sparse_k1", "offline", "offline_humanline"),
    quick_extra=(HUMANLINE_ONLINE,), repeat_arm="online", regimes=GRPO_REGIMES, choose_by=_ONLINE,
    checks=grpo_checks,
)


# ------------------------------------------------------------------------------------------ preference
def _preference_arms(objective: str, label: str, data: str, ablations: bool, scale: int = 1) -> Tuple[Arm, ...]:
    ref = f"{objective}_online"
    arms = [
        Arm(f"{objective}_offline", f"preference/{objective}_offline.yaml", f"offline {label}", "data", data=data,
            reference=ref, batch_scale=scale),
        Arm(ref, f"preference/{objective}_online.yaml", f"online {label}", "online", reference=ref),
        Arm(f"{objective}_offline_humanline", f"preference/{objective}_offline_humanline.yaml",
            f"offline humanline {label} (k=1, clip +-1.5)", "data", data=data, reference=ref, batch_scale=scale),
    ]
    if ablations:
        arms += [
            Arm(f"{objective}_sync_only", f"preference/{objective}_offline_humanline.yaml",
                f"ablation: offline {label}, sync only (k=1)", "data", ("humanline.transform=none",), data, ref),
            Arm(f"{objective}_clip_only", f"preference/{objective}_offline_humanline.yaml",
                f"ablation: offline {label}, clip only", "data", ("humanline.sync_every=null",), data, ref),
        ]
    return tuple(arms)


PREFERENCE_ARMS = (_preference_arms("dpo", "DPO", "pairs", True) + _preference_arms("kto", "KTO", "pairs", False, 2)
                   + _preference_arms("grpo", "GRPO", "groups", False))
PREFERENCE_ONLINE = ("dpo_online", "kto_online", "grpo_online")


def preference_checks(runs, repeat) -> dict:
    """Online pairs come from the current policy (a rollout at every update); offline arms never generate
    training data (no rollout at any update); one seed gives one curve."""
    by = {(r.arm, r.warmup, r.seed): r for r in runs}
    online = [m for r in runs if r.arm in PREFERENCE_ONLINE for m in r.metrics]
    offline = [m for r in runs if r.arm not in PREFERENCE_ONLINE for m in r.metrics]
    checks = {
        "online_rollout_every_update": bool(online) and all(m.get("rollout") is True for m in online),
        "offline_never_generates": bool(offline) and all("rollout" not in m for m in offline),
    }
    checks.update(same_seed_checks(by, repeat))
    return checks


PREFERENCE = Study(
    name="preference", title="Does humanline close the offline-online gap? (toy preference task, DPO / KTO / GRPO)",
    metric="held-out reward", arms=PREFERENCE_ARMS,
    quick_arms=("dpo_offline", "dpo_online", "dpo_offline_humanline", "kto_online", "grpo_offline"),
    quick_extra=(), repeat_arm="dpo_online",
    regimes={f"lr{lr}": ((f"train.lr={lr}",), PREFERENCE_ONLINE) for lr in ("3e-4", "1e-4", "3e-5")},
    choose_by=PREFERENCE_ONLINE, checks=preference_checks,
)

STUDIES = {"grpo": GRPO, "preference": PREFERENCE}

