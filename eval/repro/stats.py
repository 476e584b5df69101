"""Statistics for the reproduction study: learning curves of several arms x seeds -> AUC / final accuracy
with bootstrap confidence intervals, verdicts against a reference arm, a Markdown table and a plot.

``curves[arm][run] = (steps, accuracies)``; every run of a study must share the same steps. A run is keyed by
its seed, or by ``(warm-up seed, RL seed)`` when the study crosses several warm-up models with the RL seeds:
then every interval is a two-stage (warm-up, then seed) bootstrap, so the warm-up's variance is in it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

Curve = Tuple[List[int], List[float]]
RunKey = Union[int, Tuple[int, int]]  # an RL seed, or (warm-up seed, RL seed)
CI_NOTE = ("Intervals are bootstrap 95% CIs of the mean over runs: warm-up models resampled, then RL seeds within "
           "each (a hierarchical bootstrap) when there are several warm-ups; overlapping intervals are reported as "
           "not resolved.")


def curve_auc(steps: Sequence[int], values: Sequence[float]) -> float:
    """Normalised area under the curve: ``sum_i (s_{i+1} - s_i) * (v_i + v_{i+1}) / 2 / (s_last - s_first)``.

    A single point gives its value. Steps must be strictly increasing and match ``values`` in length.
    """
    steps_arr = np.asarray(steps, dtype=float)
    values_arr = np.asarray(values, dtype=float)
    if steps_arr.ndim != 1 or steps_arr.shape != values_arr.shape or steps_arr.size == 0:
        raise ValueError(f"need equally long, non-empty steps and values (got {len(steps)} and {len(values)})")
    if np.any(np.diff(steps_arr) <= 0):
        raise ValueError(f"steps must be strictly increasing (sorted, no duplicates): {list(steps)}")
    if steps_arr.size == 1:
        return float(values_arr[0])
    widths = np.diff(steps_arr)
    area = float(np.sum(widths * (values_arr[1:] + values_arr[:-1]) / 2.0))
    return area / float(steps_arr[-1] - steps_arr[0])


def bootstrap_ci(values: Sequence[float], n_boot: int = 10000, level: float = 0.95, seed: int = 0) -> dict:
    """Percentile bootstrap of the mean: draw ``n_boot`` resamples (with replacement, ``default_rng(seed)``),
    ``lo, hi`` = the ``(1 - level) / 2`` and ``1 - (1 - level) / 2`` quantiles of the resample means."""
    data = np.asarray(values, dtype=float)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("bootstrap_ci needs a non-empty 1-D sequence of values")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    mean = float(data.mean())
    if data.size == 1:
        return {"mean": mean, "lo": mean, "hi": mean, "n": 1}
    rng = np.random.default_rng(seed)
    resample_idx = rng.integers(0, data.size, size=(n_boot, data.size))
    resample_means = data[resample_idx].mean(axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(resample_means, [tail, 1.0 - tail])
    return {"mean": mean, "lo": float(lo), "hi": float(hi), "n": int(data.size)}


def hierarchical_bootstrap_ci(groups: Sequence[Sequence[float]], n_boot: int = 10000, level: float = 0.95,
                              seed: int = 0) -> dict:
    """Two-stage percentile bootstrap of the mean of runs nested in groups (RL seeds within warm-up models).

    Each resample draws ``len(groups)`` groups with replacement (``rng.integers``, shape ``(n_boot, G)``), then
    within each drawn group as many runs as it holds, with replacement (``floor(rng.random((n_boot, G, max_n)) *
    size)``), and takes the mean of the drawn groups' means. The estimate is the mean of the group means (the
    plain mean when groups are equally large). One group is ``bootstrap_ci`` of its values."""
    arrays = [np.asarray(g, dtype=float) for g in groups]
    if not arrays or any(a.ndim != 1 or a.size == 0 for a in arrays):
        raise ValueError("hierarchical_bootstrap_ci needs non-empty groups of values")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if len(arrays) == 1:
        return {**bootstrap_ci(arrays[0], n_boot=n_boot, level=level, seed=seed), "groups": 1}
    sizes = np.array([a.size for a in arrays])
    padded = np.zeros((len(arrays), sizes.max()))
    for i, a in enumerate(arrays):
        padded[i, :a.size] = a
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(arrays), size=(n_boot, len(arrays)))  # which groups
    within = np.floor(rng.random((n_boot, len(arrays), sizes.max())) * sizes[drawn][..., None]).astype(int)
    used = np.arange(sizes.max()) < sizes[drawn][..., None]  # the first `size` draws of each drawn group count
    values = np.where(used, padded[drawn[..., None], within], 0.0)
    resample_means = (values.sum(axis=2) / sizes[drawn]).mean(axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(resample_means, [tail, 1.0 - tail])
    return {"mean": float(np.mean([a.mean() for a in arrays])), "lo": float(lo), "hi": float(hi),
            "n": int(sizes.sum()), "groups": len(arrays)}


def grouped_ci(values_by_run: Dict[RunKey, float], n_boot: int = 10000, seed: int = 0) -> dict:
    """The CI of runs keyed by seed (one group: ``bootstrap_ci``) or by ``(warm-up, seed)`` (hierarchical)."""
    groups: Dict[int, List[float]] = {}
    for key in sorted(values_by_run):
        groups.setdefault(key[0] if isinstance(key, tuple) else 0, []).append(float(values_by_run[key]))
    return hierarchical_bootstrap_ci(list(groups.values()), n_boot=n_boot, seed=seed)


def verdict(a: dict, b: dict) -> str:
    """``"higher"`` if ``a.lo > b.hi``, ``"lower"`` if ``a.hi < b.lo``, else ``"not resolved"`` (touching overlaps)."""
    if a["lo"] > b["hi"]:
        return "higher"
    if a["hi"] < b["lo"]:
        return "lower"
    return "not resolved"


def _common_steps(curves: Dict[str, Dict[RunKey, Curve]]) -> List[int]:
    """The steps shared by every run; ValueError naming the first arm/seed whose steps differ."""
    expected: Optional[List[int]] = None
    for arm, runs in curves.items():
        if not runs:
            raise ValueError(f"arm {arm!r} has no runs")
        for run_seed, (steps, values) in runs.items():
            if len(steps) != len(values):
                raise ValueError(f"arm {arm!r} seed {run_seed}: {len(steps)} steps but {len(values)} values")
            if expected is None:
                expected = [int(s) for s in steps]
            elif [int(s) for s in steps] != expected:
                raise ValueError(f"arm {arm!r} seed {run_seed}: steps {list(steps)} differ from {expected}")
    if expected is None:
        raise ValueError("no curves given")
    return expected


def summarize(curves: Dict[str, Dict[RunKey, Curve]], reference_arm: str = "online",
              wall_clock: Optional[Dict[str, Dict[RunKey, float]]] = None, n_boot: int = 10000, seed: int = 0,
              references: Optional[Dict[str, str]] = None) -> dict:
    """Per arm: bootstrap CIs (``grouped_ci``) of the per-run AUC (``curve_auc``) and final accuracy (value at
    the last step), verdicts against its reference arm (``references[arm]``, else ``reference_arm``; None for a
    reference itself or when it is absent), and the wall-clock CI when ``wall_clock[arm][run]`` seconds are
    given. ``seeds`` lists the run keys (``[warm-up, seed]`` pairs for a crossed study). JSON-able; arms keep
    insertion order."""
    steps = _common_steps(curves)
    arms: Dict[str, dict] = {}
    for arm, runs in curves.items():
        keys = sorted(runs)
        auc = {k: curve_auc(*runs[k]) for k in keys}
        final = {k: float(runs[k][1][-1]) for k in keys}
        seconds = (wall_clock or {}).get(arm, {})
        arms[arm] = {
            "seeds": [list(k) if isinstance(k, tuple) else int(k) for k in keys],
            "auc": grouped_ci(auc, n_boot=n_boot, seed=seed),
            "final": grouped_ci(final, n_boot=n_boot, seed=seed),
            "auc_per_seed": list(auc.values()),
            "final_per_seed": list(final.values()),
            "vs_reference": None,
            "wall_clock_s": grouped_ci(seconds, n_boot=n_boot, seed=seed) if seconds else None,
        }
    for arm, stats in arms.items():
        ref = (references or {}).get(arm, reference_arm)
        stats["reference"] = ref
        if ref in arms and ref != arm:
            stats["vs_reference"] = {key: verdict(stats[key], arms[ref][key]) for key in ("auc", "final")}
    return {"steps": steps, "arms": arms, "reference_arm": reference_arm}


def pointwise_band(curves_of_arm: Dict[RunKey, Curve], n_boot: int = 2000,
                   seed: int = 0) -> Tuple[List[int], List[float], List[float], List[float]]:
    """Per step: the mean over runs and its bootstrap CI (``grouped_ci``) ``(steps, mean, lo, hi)``."""
    steps = _common_steps({"arm": curves_of_arm})
    cis = [grouped_ci({k: curve[1][i] for k, curve in curves_of_arm.items()}, n_boot=n_boot, seed=seed)
           for i in range(len(steps))]
    return steps, [c["mean"] for c in cis], [c["lo"] for c in cis], [c["hi"] for c in cis]


def _fmt_ci(ci: Optional[dict], decimals: int) -> str:
    """``mean [lo, hi]`` with ``decimals`` decimals, or an em dash for no CI."""
    if ci is None:
        return "—"
    return f"{ci['mean']:.{decimals}f} [{ci['lo']:.{decimals}f}, {ci['hi']:.{decimals}f}]"


def markdown_table(summary: dict, labels: Optional[Dict[str, str]] = None) -> str:
    """A GitHub Markdown table of ``summarize``'s output, with the CI note below it."""
    labels = labels or {}
    ref = summary["reference_arm"]
    several = len({stats.get("reference", ref) for stats in summary["arms"].values()}) > 1
    vs_header = "vs its reference arm (AUC / final)" if several else f"vs {labels.get(ref, ref)}"
    lines = [f"| arm | runs | AUC mean [lo, hi] | final mean [lo, hi] | {vs_header} | wall-clock s |",
             "|---|---|---|---|---|---|"]
    for arm, stats in summary["arms"].items():
        vs = stats.get("vs_reference")
        vs_text = f"{vs['auc']} / {vs['final']}" if vs else "—"
        groups = stats["auc"].get("groups", 1)
        runs = f"{len(stats['seeds'])} ({groups} warm-ups)" if groups > 1 else str(len(stats["seeds"]))
        lines.append(f"| {labels.get(arm, arm)} | {runs} | {_fmt_ci(stats['auc'], 3)} | "
                     f"{_fmt_ci(stats['final'], 3)} | {vs_text} | {_fmt_ci(stats.get('wall_clock_s'), 0)} |")
    return "\n".join(lines) + "\n\n" + CI_NOTE + "\n"


def plot_curves(curves: Dict[str, Dict[RunKey, Curve]], path: Union[str, Path],
                labels: Optional[Dict[str, str]] = None, title: Optional[str] = None,
                ylabel: str = "held-out accuracy") -> None:
    """One PNG: per arm the mean held-out metric over runs and its pointwise bootstrap band."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = labels or {}
    fig = Figure(figsize=(9.5, 4.5))  # wide: the legend sits beside the axes, never over a curve
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for arm, runs in curves.items():
        steps, mean, lo, hi = pointwise_band(runs)
        (line,) = ax.plot(steps, mean, marker="o", markersize=3, label=labels.get(arm, arm))
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=120)
