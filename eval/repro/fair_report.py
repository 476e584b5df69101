"""The fair preference study's result files: ``results.json`` (design, plan, tuning table, every run, statistics),
``results.md`` (tuning, the reported arms with their hierarchical intervals, the gap each humanline arm closes, sync
period, data sources, clamp binding, sanity checks, runtime) and ``curves.png`` (one panel per objective)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import stats
from .kernels import describe
from .report import clamp_binding, curves_of, generation_s, per_run
from .runs import Run

Key = Tuple[int, int]
# (humanline role, offline role, what they share) compared per objective
PAIRS = (("humanline", "offline", "tuned, weak data"),
         ("humanline@online", "offline@online", "online's values, weak data"),
         ("humanline strong", "offline strong", "tuned, strong data"),
         ("humanline mixture", "offline mixture", "tuned, mixture data"))


def _by_key(runs: Sequence[Run], arm: str, value) -> Dict[Key, float]:
    return {(r.warmup, r.seed): value(r) for r in runs if r.arm == arm}


def _auc(run: Run) -> float:
    return stats.curve_auc(*run.curve)


def _final(run: Run) -> float:
    return run.curve[1][-1]


def _start(run: Run) -> float:
    return run.curve[1][0]


def _verdict(ci: dict) -> str:
    return "higher" if ci["lo"] > 0 else "lower" if ci["hi"] < 0 else "not resolved"


def paired(runs: Sequence[Run], arm: str, against: str, value) -> dict:
    """Hierarchical bootstrap CI of the per-run difference ``arm - against`` (same warm-up and seed), its verdict."""
    a, b = _by_key(runs, arm, value), _by_key(runs, against, value)
    ci = stats.grouped_ci({k: a[k] - b[k] for k in a if k in b})
    return {**ci, "verdict": _verdict(ci)}


def gain(runs: Sequence[Run], arm: str, value) -> float:
    return statistics.fmean(value(r) - _start(r) for r in runs if r.arm == arm)


def comparisons(runs: Sequence[Run], by_role: Dict[str, Dict[str, object]], summary: dict) -> List[dict]:
    """Per objective and data source: the gains over the start, the share of the offline-online gap humanline
    closes (AUC and final), humanline - offline paired, and humanline's verdicts against online."""
    rows = []
    for objective, role in by_role.items():
        online = role["online"].name
        for hl_role, off_role, what in PAIRS:
            if hl_role not in role:
                continue
            hl, off = role[hl_role].name, role[off_role].name
            row = {"objective": objective, "compared": what, "humanline": hl, "offline": off, "online": online}
            for measure, value in (("auc", _auc), ("final", _final)):
                g = {name: gain(runs, arm, value) for name, arm
                     in (("offline", off), ("online", online), ("humanline", hl))}
                gap = g["online"] - g["offline"]
                row[measure] = {"gain": g, "share_closed": (g["humanline"] - g["offline"]) / gap if gap else None,
                                "humanline_minus_offline": paired(runs, hl, off, value),
                                "humanline_vs_online": summary["arms"][hl]["vs_reference"][measure]}
            rows.append(row)
    return rows


def sync_rows(runs: Sequence[Run], by_role, summary: dict, periods: Sequence[int]) -> List[dict]:
    """Humanline at each sync period (its tuned values): AUC, final, verdicts against online, minus offline (paired)."""
    rows = []
    for objective, role in by_role.items():
        for k in periods:
            arm = role["humanline" if k == 1 else f"humanline k={k}"].name
            entry = summary["arms"][arm]
            rows.append({"objective": objective, "k": k, "arm": arm, "auc": entry["auc"], "final": entry["final"],
                         "vs_online": entry["vs_reference"],
                         "minus_offline_auc": paired(runs, arm, role["offline"].name, _auc)})
    return rows


def clamp_rows(runs: Sequence[Run], by_role, summary: dict, binding: Dict[str, float]) -> List[dict]:
    """Online, offline and humanline (tuned, weak data) and humanline at the other bounds: the fraction of tokens
    the clamp changed (or would change), AUC, and (other bounds) the AUC difference to humanline at +-1.5."""
    rows = []
    for objective, role in by_role.items():
        humanline = role["humanline"].name
        for name in ("online", "offline", "humanline", *(r for r in role if r.startswith("humanline clip"))):
            arm = role[name].name
            rows.append({"objective": objective, "role": name, "arm": arm, "clamp_binding": binding.get(arm),
                         "auc": summary["arms"][arm]["auc"],
                         "minus_humanline_auc": paired(runs, arm, humanline, _auc) if arm != humanline and
                         name.startswith("humanline clip") else None})
    return rows


def _ci(ci: Optional[dict], digits: int = 3, sign: bool = False) -> str:
    if ci is None:
        return "—"
    f = f"+.{digits}f" if sign else f".{digits}f"
    return f"{ci['mean']:{f}} [{ci['lo']:{f}}, {ci['hi']:{f}}]"


def _share(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:+.2f}"


def tuning_lines(table: List[dict], labels: Dict[str, str]) -> List[str]:
    lines = ["| objective | arm | knob | candidates: mean held-out reward AUC on the tuning runs (chosen in bold) | "
             "tuning runs | seconds |", "|---|---|---|---|---|---|"]
    for row in table:
        cells = []
        for c in row["candidates"]:
            value = f"{c['lr']:g}" if row["knob"] == "lr" else f"{c['max_grad_norm']:g}"
            text = f"{value}: {c['auc_mean']:.3f}"
            cells.append(f"**{text}**" if c["arm"] == row["chosen"] else text)
        lines.append(f"| {row['objective'].upper()} | {row['arm']} | {row['knob']} | {', '.join(cells)} | "
                     f"{sum(len(c['auc_runs']) for c in row['candidates'])} | "
                     f"{sum(c['wall_s'] for c in row['candidates']):.0f} |")
    return lines


def tuning_cost(table: List[dict]) -> Dict[str, Dict[str, dict]]:
    """Distinct tuning settings, runs and run seconds per objective and arm (a setting in two groups counts once)."""
    cost: Dict[str, Dict[str, dict]] = {}
    for row in table:
        entry = cost.setdefault(row["objective"], {}).setdefault(row["arm"],
                                                                 {"settings": {}, "runs": 0, "seconds": 0.0})
        for c in row["candidates"]:
            entry["settings"][c["arm"]] = (len(c["auc_runs"]), c["wall_s"])
    for arms in cost.values():
        for entry in arms.values():
            entry["runs"] = sum(n for n, _ in entry["settings"].values())
            entry["seconds"] = sum(s for _, s in entry["settings"].values())
            entry["settings"] = sorted(entry["settings"])
    return cost


def source_rows(meta: dict, runs: Sequence[Run]) -> Dict[str, dict]:
    """Per source: pairs, reward means, the pair distance and the chosen reward relative to the start policy (the
    mean held-out reward at update 0 over the reported runs)."""
    start = statistics.fmean(_start(r) for r in runs)
    rows = {}
    for name, m in meta["sources"].items():
        distance = m.get("pair_distance_mean", m["chosen_reward_mean"] - m["rejected_reward_mean"])
        rows[name] = {"pairs": m["pairs"], "prompts": m["prompts"], "sample_reward_mean": m["sample_reward_mean"],
                      "chosen_reward_mean": m["chosen_reward_mean"], "rejected_reward_mean": m["rejected_reward_mean"],
                      "pair_distance_mean": distance, "start_policy_reward": start,
                      "chosen_minus_start": m["chosen_reward_mean"] - start, "writers": m.get("writers", [])}
    return rows


def plot(runs: Sequence[Run], by_role: Dict[str, Dict[str, object]], path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # plotting: only when the report is written
    from matplotlib.figure import Figure

    curves = curves_of(runs)
    fig = Figure(figsize=(6.5 * len(by_role), 4.5))
    FigureCanvasAgg(fig)
    for i, (objective, role) in enumerate(by_role.items()):
        ax = fig.add_subplot(1, len(by_role), i + 1)
        shown = [("online", "black", "-")] + [(f"{kind}{src}", color, style) for src, style in
                                              (("", "-"), (" strong", "--"), (" mixture", ":"))
                                              for kind, color in (("offline", "tab:blue"), ("humanline", "tab:red"))]
        for name, color, style in shown:
            if name not in role:
                continue
            steps, mean, lo, hi = stats.pointwise_band(curves[role[name].name])
            ax.plot(steps, mean, style, color=color, marker="o", markersize=2, label=f"{name} ({role[name].name})")
            ax.fill_between(steps, lo, hi, color=color, alpha=0.08, linewidth=0)
        ax.set_title(f"{objective.upper()}: tuned arms per data source")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("held-out reward")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)


def write_fair_report(out: Path, title: str, sync_periods: Sequence[int], runs: Sequence[Run],
                      tuning: Dict[object, List[Run]], tuning_table: List[dict], chosen: dict,
                      by_role: Dict[str, Dict[str, object]], meta: dict, checks: dict) -> dict:
    labels = {s.name: s.label for role in by_role.values() for s in role.values()}
    refs = {s.name: role["online"].name for role in by_role.values() for s in role.values()}
    first_online = next(iter(by_role.values()))["online"].name
    curves = curves_of(runs)
    summary = stats.summarize(curves, reference_arm=first_online, references=refs,
                              wall_clock=per_run(runs, lambda r: r.wall_s))
    win = curves_of(runs, win_rate=True)
    win_summary = stats.summarize(win, reference_arm=first_online, references=refs)
    binding = {arm: statistics.fmean(v.values()) for arm, v in per_run(runs, clamp_binding).items()
               if None not in v.values()}
    compared = comparisons(runs, by_role, summary)
    sources = source_rows(meta, runs)
    cost = tuning_cost(tuning_table)
    result = {"title": title, "study": "preference_fair", **meta, "labels": labels,
              "roles": {o: {k: s.name for k, s in r.items()} for o, r in by_role.items()},
              "chosen": {f"{o}_{kind}": {"arm": s.name, "lr": s.lr, "max_grad_norm": s.norm}
                         for (o, kind), s in chosen.items()},
              "tuning": tuning_table, "tuning_cost": cost, "summary": summary, "win_rate_summary": win_summary,
              "comparisons": compared, "sync_periods": sync_rows(runs, by_role, summary, sync_periods),
              "sources_table": sources, "clamp_binding": binding,
              "clamp": clamp_rows(runs, by_role, summary, binding), "sanity": checks,
              "tuning_runs": [_run_json(r) for rs in tuning.values() for r in rs],
              "runs": [_run_json(r) for r in runs]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = markdown(result, labels)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    plot(runs, by_role, out / "curves.png", title)
    print("\n".join(lines))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'curves.png'}")
    return result


def _run_json(r: Run) -> dict:
    return {"arm": r.arm, "warmup": r.warmup, "seed": r.seed, "steps": r.curve[0], "values": r.curve[1],
            "win_rate": r.win_rate, "losses": [m.get("loss") for m in r.metrics],
            "grad_norms": [m.get("grad_norm") for m in r.metrics], "wall_s": r.wall_s, "generation_s": generation_s(r),
            "clamp_binding": clamp_binding(r), "overrides": r.overrides,
            "torch_threads": r.summary.get("torch_threads"), "deterministic": r.summary.get("deterministic")}


def markdown(result: dict, labels: Dict[str, str]) -> List[str]:
    d, env = result["design"], result["environment"]
    lines = [f"# {result['title']}", "",
             f"Design (fixed in `eval/repro/fair.py` before any run): every arm tunes its learning rate on tuning runs "
             f"(warm-ups {d['tuning_warmups']} x RL seeds {d['tuning_seeds']}, never reported): online over "
             f"{', '.join(f'{x:g}' for x in d['online_lrs'])}; offline humanline and offline over "
             f"{', '.join(f'{m:g}x' for m in d['multipliers'])} online's choice; then each arm tries max grad norm "
             f"{', '.join(f'{n:g}' for n in d['norms'][1:])} at its learning rate. Rule: {d['rule']}. Reported runs: "
             f"{len(result['warmups'])} accepted warm-ups x RL seeds {d['reported_seeds']}.", "",
             "## Tuning", "", *tuning_lines(result["tuning"], labels), "",
             "Tuning cost per arm (distinct settings / runs / run seconds): " + "; ".join(
                 f"{o.upper()} {arm} {len(c['settings'])} / {c['runs']} / {c['seconds']:.0f}"
                 for o, arms in result["tuning_cost"].items() for arm, c in arms.items()) + ".", "",
             "## Does humanline close the gap?", "",
             "Gain = held-out reward AUC (final) minus the start; share = (humanline - offline) / (online - offline) "
             "gain; humanline - offline is paired by warm-up and seed (hierarchical bootstrap 95% CI).", "",
             "| objective | compared | gain AUC: offline / online / humanline | share of the gap (AUC / final) | "
             "humanline - offline, AUC | humanline - offline, final | humanline vs online (AUC / final) |",
             "|---|---|---|---|---|---|---|"]
    for row in result["comparisons"]:
        a, f = row["auc"], row["final"]
        lines.append(f"| {row['objective'].upper()} | {row['compared']} | {a['gain']['offline']:.3f} / "
                     f"{a['gain']['online']:.3f} / {a['gain']['humanline']:.3f} | {_share(a['share_closed'])} / "
                     f"{_share(f['share_closed'])} | {_ci(a['humanline_minus_offline'], sign=True)} "
                     f"{a['humanline_minus_offline']['verdict']} | {_ci(f['humanline_minus_offline'], sign=True)} "
                     f"{f['humanline_minus_offline']['verdict']} | {a['humanline_vs_online']} / "
                     f"{f['humanline_vs_online']} |")
    lines += ["", "## Every reported arm", "", "Held-out reward:", "", stats.markdown_table(result["summary"], labels),
              "Win rate against the start policy (one sampled completion per held-out prompt, ties count half):", "",
              stats.markdown_table(result["win_rate_summary"], labels), "", "## Sync period (humanline, tuned values)",
              "", "| objective | k | AUC | final | vs online (AUC / final) | humanline - offline (tuned), AUC |",
              "|---|---|---|---|---|---|"]
    for row in result["sync_periods"]:
        lines.append(f"| {row['objective'].upper()} | {row['k']} | {_ci(row['auc'])} | {_ci(row['final'])} | "
                     f"{row['vs_online']['auc']} / {row['vs_online']['final']} | "
                     f"{_ci(row['minus_offline_auc'], sign=True)} {row['minus_offline_auc']['verdict']} |")
    lines += ["", "## Offline data sources", "", "| source | pairs / prompts | sample reward | chosen | rejected | "
              "pair distance (chosen - rejected) | chosen - start policy | writers: sample reward (chosen / rejected "
              "pairs written) |", "|---|---|---|---|---|---|---|---|"]
    for name, s in result["sources_table"].items():
        writers = "; ".join(f"{Path(w['model']).parent.name} {w['sample_reward_mean']:.3f} ({w['chosen']}/"
                            f"{w['rejected']})" for w in s["writers"]) or "—"
        lines.append(f"| {name} | {s['pairs']} / {s['prompts']} | {s['sample_reward_mean']:.3f} | "
                     f"{s['chosen_reward_mean']:.3f} | {s['rejected_reward_mean']:.3f} | {s['pair_distance_mean']:.3f} "
                     f"| {s['chosen_minus_start']:+.3f} (start {s['start_policy_reward']:.3f}) | {writers} |")
    lines += ["", "## Where the clamp binds", "", "Fraction of log-ratio tokens the clamp changed (humanline arms, "
              "their bounds against the synced reference), or would change (other arms: +-1.5 against their frozen "
              "start-policy reference), mean over updates and runs:", "", "| arm | tokens changed | AUC | "
              "vs humanline at +-1.5, AUC |", "|---|---|---|---|"]
    for row in result["clamp"]:
        binding = "—" if row["clamp_binding"] is None else f"{row['clamp_binding']:.4f}"
        diff = row["minus_humanline_auc"]
        lines.append(f"| {labels[row['arm']]} | {binding} | {_ci(row['auc'])} | "
                     f"{_ci(diff, sign=True) + ' ' + diff['verdict'] if diff else '—'} |")
    wall = result["wall_s"]
    lines += ["", "## Sanity checks and runtime", "",
              "Sanity checks: " + ", ".join(f"{k} = {v}" for k, v in result["sanity"].items()) + ".", "",
              "Warm-ups tried (accepted at held-out accuracy >= the grid's minimum): " + ", ".join(
                  f"seed {w['seed']} {w['accuracy']:.3f} ({'accepted' if w['accepted'] else 'rejected'})"
                  for w in result["warmup_acceptance"]) + ".", "",
              f"Runtime: {wall / 60:.1f} min in all (planned ETA {result['plan']['eta_s'] / 60:.1f} min); " + ", ".join(
                  f"{stage} {s / 60:.1f} min" for stage, s in result["stage_wall_s"].items())
              + f". {len(result['runs'])}"
              f" reported runs and {len(result['tuning_runs'])} tuning runs; {env['cpu_count']} CPUs, "
              f"{env['parallel_jobs']} runs at a time, 1 thread each, deterministic algorithms; torch {env['torch']}, "
              f"transformers {env['transformers']}, deepspeed {env['deepspeed']}; commit {env['git_commit']}; "
              f"{describe(env.get('kernel_fingerprint'))}.", ""]
    return lines
