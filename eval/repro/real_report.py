"""The real-model study's report: ``results.json`` (every finished cell, the offline sets, the statistics),
``results.md`` rendered from the JSON's ``summary`` alone, and ``curves.png``.

Statistics (``summarize``): per arm, the mean over seeds of each measure and its percentile bootstrap 95% interval
(``stats.bootstrap_ci``, 10,000 resamples of the seeds); per comparison (an arm against ``offline`` and ``online``),
the share of the online-minus-offline gap it closes, ``(arm - offline) / (online - offline)`` of the means, with a
paired bootstrap over the seeds the three arms share (each resample draws seeds with replacement and takes all
three arms' values of those seeds, so the seed's offline set and start go with it). With three seeds a resample
holds one of only ten seed multisets: the intervals are coarse, and where the gap's own interval holds 0 the share
is not resolved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from . import stats

MEASURES = {  # key -> (label, decimals)
    "held_out_start": ("held-out reward at update 0", 3),
    "held_out_end": ("held-out reward at the last update", 3),
    "gain": ("gain (last - start)", 3),
    "auc": ("held-out reward AUC over updates", 3),
    "greedy_right_sum": ("greedy answers holding the right sum (of 48)", 1),
}
COMPARED = "held_out_end"  # the gap share's measure
N_BOOT = 10000
INTERVAL = ("percentile bootstrap 95% intervals over seeds (10,000 resamples, numpy default_rng(0)); the gap share "
            "resamples the seeds the three arms share, paired")


def values(run: dict) -> Dict[str, float]:
    """A cell's measures (``MEASURES``) from its record."""
    return {"held_out_start": run["held_out_start"], "held_out_end": run["held_out_end"],
            "gain": run["held_out_end"] - run["held_out_start"], "auc": stats.curve_auc(run["steps"], run["held_out"]),
            "greedy_right_sum": float(run["greedy_right_sum"])}


def gap_share(by_seed: Dict[str, Dict[int, float]], arm: str, n_boot: int = N_BOOT, seed: int = 0) -> Optional[dict]:
    """``(arm - offline) / (online - offline)`` of the means over the seeds all three share, with a paired
    percentile bootstrap over those seeds; the gap and the gain over offline with their intervals. None without
    shared seeds."""
    shared = sorted(set(by_seed.get(arm, {})) & set(by_seed.get("offline", {})) & set(by_seed.get("online", {})))
    if not shared:
        return None
    on, off, it = (np.array([by_seed[a][s] for s in shared]) for a in ("online", "offline", arm))
    gap_ci = stats.bootstrap_ci(on - off, n_boot=n_boot, seed=seed)
    closed_ci = stats.bootstrap_ci(it - off, n_boot=n_boot, seed=seed)
    share = float((it - off).mean() / (on - off).mean()) if (on - off).mean() != 0 else None
    out = {"seeds": shared, "gap": gap_ci, "closed": closed_ci, "share": share, "share_lo": None, "share_hi": None,
           "gap_resolved": gap_ci["lo"] > 0 or gap_ci["hi"] < 0}
    if len(shared) > 1:
        draw = np.random.default_rng(seed).integers(0, len(shared), size=(n_boot, len(shared)))
        gaps = (on - off)[draw].mean(axis=1)
        ratios = (it - off)[draw].mean(axis=1)[gaps != 0] / gaps[gaps != 0]
        if ratios.size:
            out["share_lo"], out["share_hi"] = (float(q) for q in np.quantile(ratios, [0.025, 0.975]))
        out["resamples_with_zero_gap"] = int((gaps == 0).sum())
    return out


def cost(runs: Sequence[dict], sets: Dict[int, dict]) -> dict:
    """Mean seconds per cell: the run (wall, CPU), its rollout phase and updates, the rest, the greedy evaluation,
    and for offline arms the offline set's generation (paid once per seed, shared by the seed's offline arms)."""
    keys = ("wall_s", "cpu_s", "rollout_wall_s", "rollout_cpu_s", "update_wall_s", "update_cpu_s", "other_wall_s",
            "other_cpu_s", "greedy_wall_s", "greedy_cpu_s")
    out = {k: float(np.mean([r[k] for r in runs])) for k in keys if all(r.get(k) is not None for r in runs)}
    own = [sets[r["seed"]] for r in runs if "offline_set" in r and r["seed"] in sets]
    if own:
        out["set_generation_wall_s"] = float(np.mean([s["generation_wall_s"] for s in own]))
        out["set_generation_cpu_s"] = float(np.mean([s["generation_cpu_s"] for s in own]))
    return out


def summarize(results: dict) -> dict:
    """Per arm: the seeds, each measure's mean and interval, the costs; the gap shares; the sanity checks."""
    runs = results["runs"]
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    sets = {s["seed"]: s for s in results.get("offline_sets", [])}
    per_arm, by_seed = {}, {}
    for arm in arms:
        mine = sorted((r for r in runs if r["arm"] == arm), key=lambda r: r["seed"])
        table = [values(r) for r in mine]
        per_arm[arm] = {"seeds": [r["seed"] for r in mine],
                        **{k: stats.bootstrap_ci([t[k] for t in table], n_boot=N_BOOT) for k in MEASURES},
                        "per_seed": {k: [t[k] for t in table] for k in MEASURES}, "cost": cost(mine, sets)}
        by_seed[arm] = {r["seed"]: values(r)[COMPARED] for r in mine}
    gaps = {arm: gap_share(by_seed, arm) for arm in arms if arm not in ("offline", "online")}
    return {"arms": per_arm, "gap_share": {a: g for a, g in gaps.items() if g is not None}, "measure": COMPARED,
            "interval": INTERVAL, "sanity": sanity(results)}


def sanity(results: dict) -> dict:
    """Facts every cell should show: one thread, deterministic algorithms; plain online's ratio exactly 1;
    offline arms sample only at update 0 (their set, replayed); each seed's set holds the prompts and samples per
    prompt the online arms drew, and its update-0 groups are theirs to the token; one start per seed."""
    runs = results["runs"]
    sets = {s["seed"]: s for s in results.get("offline_sets", [])}
    checks = {"one_thread_deterministic": all(r["torch_threads"] == 1 and r["deterministic"] for r in runs)}
    online = [r for r in runs if r["arm"] == "online"]
    if online:
        checks["online_ratio_exactly_one"] = all(v == 1.0 for r in online for v in r["ratio_mean"])
    offline = [r for r in runs if "offline_set" in r]
    if offline:
        checks["offline_rollout_only_at_update_0"] = all(r["rollout_updates"] == [0] for r in offline)
    pairs = [(r, sets[r["seed"]]) for r in runs
             if "sampled" in r and r["seed"] in sets and "digests" in sets[r["seed"]]]
    if pairs:
        checks["offline_set_same_prompts_as_online"] = all(
            sorted(tuple(d[:3]) for d in s["digests"]) == sorted(tuple(d[:3]) for d in r["sampled"]) for r, s in pairs)
        checks["offline_set_update0_equals_online_update0"] = all(
            sorted(d for d in s["digests"] if d[0] == 0) == sorted(d for d in r["sampled"] if d[0] == 0)
            for r, s in pairs)
    starts: Dict[int, set] = {}
    for r in runs:
        starts.setdefault(r["seed"], set()).add(r["held_out_start"])
    checks["same_start_per_seed"] = all(len(v) == 1 for v in starts.values())
    return checks


# ------------------------------------------------------------------------------------------------ markdown
def _ci(entry: dict, decimals: int) -> str:
    return f"{entry['mean']:.{decimals}f} [{entry['lo']:.{decimals}f}, {entry['hi']:.{decimals}f}]"


def _min(seconds: Optional[float]) -> str:
    return "—" if seconds is None else f"{seconds / 60:.1f}"


def measures_table(summary: dict, labels: Dict[str, str]) -> List[str]:
    lines = ["| arm | seeds | " + " | ".join(label for label, _ in MEASURES.values()) + " |",
             "|---|---|" + "---|" * len(MEASURES)]
    for arm, entry in summary["arms"].items():
        cells = " | ".join(_ci(entry[k], d) for k, (_, d) in MEASURES.items())
        lines.append(f"| {labels.get(arm, arm)} | {len(entry['seeds'])} | {cells} |")
    return lines


def seed_lines(summary: dict, labels: Dict[str, str]) -> List[str]:
    """Per arm and seed: the held-out reward at update 0 and at the last update, and the greedy right sums."""
    seeds = sorted({s for entry in summary["arms"].values() for s in entry["seeds"]})
    lines = ["| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |", "|---|" + "---|" * len(seeds)]
    for arm, entry in summary["arms"].items():
        per = entry["per_seed"]
        cells = {s: f"{per['held_out_start'][i]:.3f} -> {per['held_out_end'][i]:.3f} ({per['greedy_right_sum'][i]:.0f})"
                 for i, s in enumerate(entry["seeds"])}
        lines.append(f"| {labels.get(arm, arm)} | " + " | ".join(cells.get(s, "—") for s in seeds) + " |")
    return lines


def gap_lines(summary: dict, labels: Dict[str, str]) -> List[str]:
    lines = ["| arm | seeds | online - offline | arm - offline | share of the gap closed [interval] |",
             "|---|---|---|---|---|"]
    for arm, g in summary["gap_share"].items():
        share = "—" if g["share"] is None else f"{g['share']:.2f}"
        if g["share_lo"] is not None:
            share += f" [{g['share_lo']:.2f}, {g['share_hi']:.2f}]"
        if not g["gap_resolved"]:
            share += " (gap not resolved)"
        lines.append(f"| {labels.get(arm, arm)} | {len(g['seeds'])} | {_ci(g['gap'], 3)} | {_ci(g['closed'], 3)} | "
                     f"{share} |")
    return lines


def cost_lines(summary: dict, labels: Dict[str, str]) -> List[str]:
    lines = ["| arm | run wall / CPU | rollout phase wall / CPU | updates without it wall / CPU | loading, held-out "
             "evals, saving wall / CPU | offline set's generation wall / CPU (once per seed, shared) |",
             "|---|---|---|---|---|---|"]
    for arm, entry in summary["arms"].items():
        c = entry["cost"]
        pair = [f"{_min(c.get(w))} / {_min(c.get(p))}" for w, p in (
            ("wall_s", "cpu_s"), ("rollout_wall_s", "rollout_cpu_s"), ("update_wall_s", "update_cpu_s"),
            ("other_wall_s", "other_cpu_s"), ("set_generation_wall_s", "set_generation_cpu_s"))]
        if "set_generation_wall_s" not in c:
            pair[-1] = "—"
        lines.append(f"| {labels.get(arm, arm)} | " + " | ".join(pair) + " |")
    return lines


def render(results: dict, labels: Dict[str, str]) -> str:
    """``results.md`` from ``results.json`` (its ``summary``, sets and environment) alone."""
    summary, env = results["summary"], results.get("environment", {})
    sets = results.get("offline_sets", [])
    lines = [f"# {results['title']}", "", f"{len(results['runs'])} finished cells. Mean over seeds [95% interval]; "
             f"{summary['interval']}.", "", *measures_table(summary, labels), "",
             "Per seed: held-out reward at update 0 -> at the last update (greedy answers holding the right sum):", "",
             *seed_lines(summary, labels), "",
             f"Share of the online-minus-offline gap closed, on the {MEASURES[summary['measure']][0]}:", "",
             *gap_lines(summary, labels), "", "Cost per cell, mean minutes (wall-clock / CPU). The rollout phase is "
             "the pack's own timer: sampling and scoring, and for plain GRPO the behaviour policy's log-probs; an "
             "offline arm's rollout phase replays its set (plain GRPO: the initial policy's log-probs of it). The "
             "greedy evaluation afterwards is not in these columns.", "", *cost_lines(summary, labels), ""]
    if sets:
        lines += ["Offline sets (one per seed, sampled once from the initial model): " + "; ".join(
            f"seed {s['seed']}: {s['groups']} groups of {'/'.join(map(str, s['samples_per_group']))}, mean score "
            f"{s['score_mean']:.3f}, generation {s['generation_wall_s'] / 60:.1f} min wall / "
            f"{s['generation_cpu_s'] / 60:.1f} min CPU" for s in sets) + ".", ""]
    lines += ["Sanity checks: " + ", ".join(f"{k} = {v}" for k, v in summary["sanity"].items()) + ".", ""]
    if env:
        lines += [f"Environment: {env.get('cpu_count')} CPUs, {env.get('parallel_jobs')} run at a time, 1 thread, "
                  f"deterministic algorithms, {env.get('cpu_kernels')}; torch {env.get('torch')}, transformers "
                  f"{env.get('transformers')}, deepspeed {env.get('deepspeed')}; commits "
                  + ", ".join(sorted({str(r.get('git_commit'))[:10] for r in results['runs']})) + ".", ""]
    return "\n".join(lines)


def write_report(out: Path, results: dict, labels: Dict[str, str]) -> dict:
    """``summary`` into ``results``; ``results.json``, ``results.md`` and ``curves.png`` under ``out``."""
    results = {**results, "summary": summarize(results)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    text = render(results, labels)
    (out / "results.md").write_text(text)
    curves = {}
    for r in results["runs"]:
        curves.setdefault(r["arm"], {})[r["seed"]] = (r["steps"], r["held_out"])
    stats.plot_curves(curves, out / "curves.png", labels=labels, title="SmolLM2-135M-Instruct, two-digit additions",
                      ylabel="held-out reward (one sample per problem)")
    print(text, flush=True)
    return results
