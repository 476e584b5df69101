"""Plots + a small HTML page from one or several runs' ``metrics.jsonl``, to compare online / offline /
humanline runs by looking.

Usage::

    python -m eval.report RUN_OR_METRICS [RUN_OR_METRICS ...] --output DIR [--smooth 0.9] [--title T]

Each argument is a run directory (holding ``metrics.jsonl``, optionally ``eval.jsonl``, ``summary.json``
and ``eval/*.json``) or a ``metrics.jsonl`` file; ``LABEL=PATH`` names the run (default: the directory
name). Writes to DIR:

* ``loss.png``: training loss per update (held-out loss from ``eval.jsonl`` dashed);
* ``reward_margin.png``: ``rewards/margin`` (DPO), or ``rewards/desirable - rewards/undesirable`` (KTO);
  held-out margin dashed;
* ``unclamped_frac.png``: fraction of tokens inside the humanline clip range;
* ``reward.png``: the logged rewards (``rewards/chosen``/``rewards/rejected``, ``rewards/desirable``/...,
  GRPO ``reward``/``score`` keys when logged);
* ``step_time.png``: step time per update with the sync part, and each run's mean split into compute vs
  reference sync (vs rollout when logged);
* ``index.html``: a table per run (updates, final loss/margin, mean step time, sync share, tokens/s and any
  ``eval/*.json`` results: MATH500 pass@1, AlpacaEval win rates, data-quality proxy) and the plots.

A plot whose metric no run logged is still written, saying so, so the page always has the same layout.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._common import EvalError, read_jsonl, require_matplotlib

PLOTS = ("loss", "reward_margin", "unclamped_frac", "reward", "step_time")
REWARD_EXCLUDE = ("rewards/margin", "rewards/accuracy")


@dataclass
class Run:
    label: str
    path: Path
    metrics: List[Dict[str, Any]]
    evals: List[Dict[str, Any]] = field(default_factory=list)
    summary: Dict[str, Any] = field(default_factory=dict)
    results: Dict[str, Dict[str, Any]] = field(default_factory=dict)


def load_run(spec: str) -> Run:
    """A run from ``PATH`` or ``LABEL=PATH`` (a run directory or a metrics.jsonl file)."""
    label, sep, path_s = spec.partition("=")
    if not sep or os.path.exists(spec):
        label, path_s = "", spec
    path = Path(path_s)
    if path.is_dir():
        run_dir, metrics_path = path, path / "metrics.jsonl"
    else:
        run_dir, metrics_path = path.parent, path
    if not metrics_path.is_file():
        raise EvalError(f"{metrics_path}: no metrics file. Fix: pass a run directory (with metrics.jsonl) or the file.")
    metrics = read_jsonl(metrics_path)
    if not metrics:
        raise EvalError(f"{metrics_path}: no metrics rows.")
    run = Run(label=label or run_dir.resolve().name, path=run_dir, metrics=metrics)
    evals_path = run_dir / "eval.jsonl"
    if metrics_path.name == "metrics.jsonl" and evals_path.is_file():
        run.evals = read_jsonl(evals_path)
    if (run_dir / "summary.json").is_file():
        try:
            run.summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError:
            pass
    for f in sorted((run_dir / "eval").glob("*.json")) if (run_dir / "eval").is_dir() else []:
        try:
            obj = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            run.results[f.stem] = obj
    return run


# --------------------------------------------------------------------------------------------- series


def series(rows: Sequence[Dict[str, Any]], key: str) -> Tuple[List[float], List[float]]:
    xs, ys = [], []
    for i, r in enumerate(rows):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(float(r.get("step", i)))
            ys.append(float(v))
    return xs, ys


def margin_series(rows: Sequence[Dict[str, Any]]) -> Tuple[List[float], List[float]]:
    xs, ys = series(rows, "rewards/margin")
    if xs:
        return xs, ys
    xs, ys = [], []
    for i, r in enumerate(rows):
        d, u = r.get("rewards/desirable"), r.get("rewards/undesirable")
        if isinstance(d, (int, float)) and isinstance(u, (int, float)):
            xs.append(float(r.get("step", i)))
            ys.append(float(d) - float(u))
    return xs, ys


def reward_keys(rows: Sequence[Dict[str, Any]]) -> List[str]:
    keys = []
    for r in rows:
        for k, v in r.items():
            if k in keys or k in REWARD_EXCLUDE or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            if k.startswith("rewards/") or k.startswith("reward") or k.startswith("score"):
                keys.append(k)
    return keys


def smooth(ys: List[float], alpha: float) -> List[float]:
    """Exponential moving average (``alpha`` = weight of the past; 0 = raw)."""
    if not alpha or not ys:
        return ys
    out, acc = [], ys[0]
    for y in ys:
        acc = alpha * acc + (1 - alpha) * y
        out.append(acc)
    return out


# --------------------------------------------------------------------------------------------- plots


def _figure(title: str, ylabel: str, figsize=(7.0, 4.0)):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    ax.set_title(title)
    ax.set_xlabel("optimizer update")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _finish(fig, ax, path: Path, drew: bool, what: str) -> Path:
    import matplotlib.pyplot as plt

    if drew:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"no run logged {what}", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _colors(n: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def plot_line(runs: Sequence[Run], key_fn, path: Path, title: str, ylabel: str, what: str, alpha: float) -> Path:
    fig, ax = _figure(title, ylabel)
    drew = False
    for run, color in zip(runs, _colors(len(runs))):
        xs, ys = key_fn(run.metrics)
        if xs:
            ax.plot(xs, smooth(ys, alpha), color=color, label=f"{run.label} (train)")
            drew = True
        xs, ys = key_fn(run.evals) if run.evals else ([], [])
        if xs:
            ax.plot(xs, ys, color=color, linestyle="--", marker="o", markersize=3, label=f"{run.label} (held-out)")
            drew = True
    return _finish(fig, ax, path, drew, what)


def plot_rewards(runs: Sequence[Run], path: Path, alpha: float) -> Path:
    """The logged training rewards per update (lines), and the held-out ones of ``eval.jsonl`` (dots)."""
    fig, ax = _figure("rewards", "reward")
    styles = ["-", "--", ":", "-."]
    drew = False
    for run, color in zip(runs, _colors(len(runs))):
        for j, key in enumerate(reward_keys(run.metrics)):
            xs, ys = series(run.metrics, key)
            if xs:
                ax.plot(xs, smooth(ys, alpha), color=color, linestyle=styles[j % len(styles)],
                        label=f"{run.label} {key}")
                drew = True
        for j, key in enumerate(reward_keys(run.evals)):
            xs, ys = series(run.evals, key)
            if xs:
                ax.plot(xs, ys, color=color, linestyle=styles[j % len(styles)], marker="o",
                        label=f"{run.label} held-out {key}")
                drew = True
    return _finish(fig, ax, path, drew, "reward metrics")


def plot_step_time(runs: Sequence[Run], path: Path, alpha: float) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11.0, 4.0), gridspec_kw={"width_ratios": [3, 2]})
    ax1.set_title("step time")
    ax1.set_xlabel("optimizer update")
    ax1.set_ylabel("seconds")
    ax1.grid(alpha=0.3)
    ax2.set_title("mean step time split")
    ax2.set_ylabel("seconds per update")
    drew = False
    labels, compute, sync, rollout = [], [], [], []
    for run, color in zip(runs, _colors(len(runs))):
        xs, ys = series(run.metrics, "step_time_s")
        if not xs:
            continue
        drew = True
        ax1.plot(xs, smooth(ys, alpha), color=color, label=f"{run.label} step")
        sx, sy = series(run.metrics, "sync_time_s")
        if sx:
            ax1.plot(sx, smooth(sy, alpha), color=color, linestyle=":", label=f"{run.label} sync")
        step_mean = sum(ys) / len(ys)
        sync_mean = sum(sy) / len(sy) if sy else 0.0
        rk = next((k for k in ("rollout_time_s", "generation_time_s", "gen_time_s") if series(run.metrics, k)[0]), None)
        roll_mean = 0.0
        if rk:
            ry = series(run.metrics, rk)[1]
            roll_mean = sum(ry) / len(ry)
        labels.append(run.label)
        sync.append(sync_mean)
        rollout.append(roll_mean)
        compute.append(max(step_mean - sync_mean - roll_mean, 0.0))
    if drew:
        ax1.legend(fontsize=8)
        pos = list(range(len(labels)))
        ax2.bar(pos, compute, label="compute (forward/backward/step)")
        ax2.bar(pos, sync, bottom=compute, label="reference sync")
        if any(rollout):
            ax2.bar(pos, rollout, bottom=[c + s for c, s in zip(compute, sync)], label="rollout")
        ax2.set_xticks(pos)
        ax2.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax2.legend(fontsize=8)
    else:
        ax1.text(0.5, 0.5, "no run logged step_time_s", ha="center", va="center", transform=ax1.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------- html


def _mean(rows, key) -> Optional[float]:
    ys = series(rows, key)[1]
    return sum(ys) / len(ys) if ys else None


def _last(rows, key) -> Optional[float]:
    ys = series(rows, key)[1]
    return ys[-1] if ys else None


def run_summary(run: Run) -> Dict[str, Any]:
    step = _mean(run.metrics, "step_time_s")
    sync = _mean(run.metrics, "sync_time_s")
    margin = margin_series(run.metrics)[1]
    out: Dict[str, Any] = {
        "updates": len(run.metrics),
        "final loss": _last(run.metrics, "loss"),
        "final margin": margin[-1] if margin else None,
        "final held-out loss": _last(run.evals, "loss") if run.evals else None,
        "mean step s": step,
        "sync share": (sync / step) if (step and sync is not None) else None,
        "tokens/s": _mean(run.metrics, "tokens_per_s"),
        "unclamped frac (last)": _last(run.metrics, "unclamped_frac"),
    }
    m = run.results.get("math500")
    if m and m.get("pass@1") is not None:
        out["MATH500 pass@1"] = f"{m['pass@1']:.3f} ± {m.get('pass@1_std') or 0:.3f} (n={m.get('n_samples')})"
    a = run.results.get("alpaca_eval")
    if a and a.get("win_rate") is not None:
        txt = f"WR {a['win_rate']:.1f}"
        if a.get("length_controlled_winrate") is not None:
            txt = f"LC {a['length_controlled_winrate']:.1f} / " + txt
        out["AlpacaEval"] = txt
    d = run.results.get("data_quality")
    if d and d.get("mean_logp") is not None:
        out["data quality (mean logp)"] = f"{d['mean_logp']:.3f}"
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_html(runs: Sequence[Run], pngs: Dict[str, Path], path: Path, title: str) -> Path:
    summaries = [run_summary(r) for r in runs]
    cols: List[str] = []
    for s in summaries:
        cols += [k for k in s if k not in cols]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in ["run", "path"] + cols)
    body = ""
    for run, s in zip(runs, summaries):
        cells = [html.escape(run.label), html.escape(str(run.path))] + [html.escape(_fmt(s.get(c))) for c in cols]
        body += "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>\n"
    figs = "".join(
        f'<figure><img src="{html.escape(p.name)}" alt="{html.escape(name)}"><figcaption>{html.escape(name)}'
        f"</figcaption></figure>\n"
        for name, p in pngs.items()
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;
padding:4px 8px;text-align:right}}td:first-child,th:first-child{{text-align:left}}figure{{display:inline-block;
margin:1em}}img{{max-width:100%}}</style></head>
<body><h1>{html.escape(title)}</h1>
<table><thead><tr>{head}</tr></thead><tbody>
{body}</tbody></table>
{figs}</body></html>
"""
    path.write_text(page, encoding="utf-8")
    return path


# --------------------------------------------------------------------------------------------- entry points


def render_report(
    runs: Sequence[str], output_dir: str, smooth_alpha: float = 0.0, title: Optional[str] = None
) -> Dict[str, Any]:
    """Write the PNGs and ``index.html`` for ``runs`` (paths or ``LABEL=PATH``); returns their paths."""
    if not runs:
        raise EvalError("report needs at least one run directory or metrics.jsonl file.")
    if not (0.0 <= float(smooth_alpha) < 1.0):
        raise EvalError(f"--smooth must be in [0, 1), got {smooth_alpha}.")
    require_matplotlib("python -m eval.report (the plots)")
    loaded = [load_run(r) for r in runs]
    seen: Dict[str, int] = {}
    for run in loaded:  # keep labels unique
        if run.label in seen:
            seen[run.label] += 1
            run.label = f"{run.label}#{seen[run.label]}"
        else:
            seen[run.label] = 1
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    a = float(smooth_alpha)
    pngs = {
        "loss": plot_line(loaded, lambda rows: series(rows, "loss"), out / "loss.png", "loss", "loss", "loss", a),
        "reward_margin": plot_line(loaded, margin_series, out / "reward_margin.png", "reward margin",
                                   "margin", "a reward margin", a),
        "unclamped_frac": plot_line(loaded, lambda rows: series(rows, "unclamped_frac"), out / "unclamped_frac.png",
                                    "fraction of tokens inside the humanline clip", "fraction", "unclamped_frac", a),
        "reward": plot_rewards(loaded, out / "reward.png", a),
        "step_time": plot_step_time(loaded, out / "step_time.png", a),
    }
    page = write_html(loaded, pngs, out / "index.html", title or "humanline runs: "
                      + ", ".join(r.label for r in loaded))
    return {"pngs": {k: str(v) for k, v in pngs.items()}, "html": str(page), "runs": [r.label for r in loaded]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.report", description="Plots + HTML from runs' metrics.jsonl.")
    p.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files (LABEL=PATH to name them)")
    p.add_argument("--output", "-o", required=True, help="directory for the PNGs and index.html")
    p.add_argument("--smooth", type=float, default=0.0, help="EMA weight of the past for training curves, in [0, 1)")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    res = render_report(a.runs, a.output, a.smooth, a.title)
    print(f"wrote {res['html']} and {len(res['pngs'])} plots")
    return 0


if __name__ == "__main__":
    from hl_core.errors import exit_on_user_error

    exit_on_user_error(main)
