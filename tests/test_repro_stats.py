"""eval.repro.stats: curve AUC against hand values, the percentile bootstrap against a plain-loop recomputation
and the normal approximation, verdicts (touching intervals included), summarize/markdown_table on synthetic
arms, and the plot."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from eval.repro.stats import (
    CI_NOTE,
    bootstrap_ci,
    curve_auc,
    grouped_ci,
    hierarchical_bootstrap_ci,
    markdown_table,
    plot_curves,
    pointwise_band,
    summarize,
    verdict,
)

STEPS = [0, 16, 32, 48, 64]


def make_curves(level_by_arm, n_seeds=5, noise=0.05, steps=STEPS):
    """curves[arm][seed]: a rising curve towards ``level`` plus run-specific noise (independent across arms)."""
    curves = {}
    for arm_index, (arm, level) in enumerate(level_by_arm.items()):
        curves[arm] = {}
        for seed in range(n_seeds):
            rng = np.random.default_rng(1000 * arm_index + seed)
            values = [level * (i + 1) / len(steps) + noise * rng.standard_normal() for i in range(len(steps))]
            curves[arm][seed] = (list(steps), values)
    return curves


# ------------------------------------------------------------------------------------------------ curve_auc


def test_curve_auc_hand_values():
    assert curve_auc([0, 10, 20], [0, 1, 1]) == pytest.approx(0.75)
    assert curve_auc([0, 10, 30], [0, 1, 1]) == pytest.approx((5 + 20) / 30)  # uneven spacing
    assert curve_auc([5, 7], [0.2, 0.6]) == pytest.approx(0.4)
    assert curve_auc([16], [0.3]) == pytest.approx(0.3)


@pytest.mark.parametrize("steps, values", [([0, 20, 10], [0, 1, 1]), ([0, 10, 10], [0, 1, 1]),
                                           ([0, 10], [0, 1, 1]), ([], [])])
def test_curve_auc_errors(steps, values):
    with pytest.raises(ValueError):
        curve_auc(steps, values)


# --------------------------------------------------------------------------------------------- bootstrap_ci


def test_bootstrap_constant_and_single_value():
    ci = bootstrap_ci([0.4] * 6, n_boot=200)
    assert ci["mean"] == pytest.approx(0.4) and ci["lo"] == pytest.approx(0.4) and ci["hi"] == pytest.approx(0.4)
    assert ci["n"] == 6
    assert bootstrap_ci([0.7]) == {"mean": 0.7, "lo": 0.7, "hi": 0.7, "n": 1}


def test_bootstrap_deterministic_for_a_seed():
    values = [0.1, 0.5, 0.3, 0.9, 0.2]
    assert bootstrap_ci(values, n_boot=500, seed=3) == bootstrap_ci(values, n_boot=500, seed=3)
    assert bootstrap_ci(values, n_boot=500, seed=3) != bootstrap_ci(values, n_boot=500, seed=4)


def test_bootstrap_contains_mean_and_narrows():
    rng = np.random.default_rng(0)
    wide = bootstrap_ci(rng.normal(0.5, 0.2, size=5), n_boot=2000)
    narrow = bootstrap_ci(rng.normal(0.5, 0.02, size=50), n_boot=2000)
    for ci in (wide, narrow):
        assert ci["lo"] < ci["mean"] < ci["hi"]
    assert narrow["hi"] - narrow["lo"] < (wide["hi"] - wide["lo"]) / 10


def test_bootstrap_matches_plain_loop():
    """Same rng draws, but means and the linear-interpolation percentiles computed by hand."""
    values = [0.12, 0.55, 0.31, 0.78, 0.44, 0.09, 0.66]
    n_boot, level, seed = 999, 0.9, 11
    idx = np.random.default_rng(seed).integers(0, len(values), size=(n_boot, len(values)))
    means = sorted(sum(values[j] for j in row) / len(values) for row in idx.tolist())

    def percentile(q):
        h = (len(means) - 1) * q
        k = math.floor(h)
        return means[k] + (h - k) * (means[min(k + 1, len(means) - 1)] - means[k])

    ci = bootstrap_ci(values, n_boot=n_boot, level=level, seed=seed)
    assert ci["mean"] == pytest.approx(sum(values) / len(values))
    assert ci["lo"] == pytest.approx(percentile(0.05), abs=1e-12)
    assert ci["hi"] == pytest.approx(percentile(0.95), abs=1e-12)


def test_bootstrap_close_to_normal_interval():
    sample = np.random.default_rng(5).normal(2.0, 1.0, size=400)
    half = 1.96 * sample.std(ddof=1) / math.sqrt(sample.size)
    ci = bootstrap_ci(sample, n_boot=4000, seed=1)
    assert ci["lo"] == pytest.approx(sample.mean() - half, abs=0.1 * half)
    assert ci["hi"] == pytest.approx(sample.mean() + half, abs=0.1 * half)


def test_bootstrap_rejects_empty():
    with pytest.raises(ValueError):
        bootstrap_ci([])


# -------------------------------------------------------------------------------------------------- verdict


@pytest.mark.parametrize("a, b, expected", [
    ((0.6, 0.7), (0.4, 0.5), "higher"),
    ((0.4, 0.5), (0.6, 0.7), "lower"),
    ((0.4, 0.6), (0.5, 0.7), "not resolved"),
    ((0.5, 0.6), (0.4, 0.5), "not resolved"),  # touching: a.lo == b.hi
    ((0.4, 0.5), (0.5, 0.6), "not resolved"),  # touching: a.hi == b.lo
])
def test_verdict(a, b, expected):
    def as_ci(lo_hi):
        return {"mean": sum(lo_hi) / 2, "lo": lo_hi[0], "hi": lo_hi[1], "n": 3}

    assert verdict(as_ci(a), as_ci(b)) == expected


# ------------------------------------------------------------------------------------------------ summarize


def test_summarize_clear_gap_and_overlap():
    curves = make_curves({"online": 0.8, "sparse": 0.4, "humanline_k1": 0.8})
    wall = {"online": {s: 100.0 + s for s in range(5)}}
    summary = summarize(curves, wall_clock=wall, n_boot=500)
    json.dumps(summary)  # JSON-able
    assert summary["steps"] == STEPS and summary["reference_arm"] == "online"
    assert list(summary["arms"]) == ["online", "sparse", "humanline_k1"]
    online, sparse, hl = (summary["arms"][a] for a in ("online", "sparse", "humanline_k1"))
    assert online["seeds"] == [0, 1, 2, 3, 4] and len(online["auc_per_seed"]) == 5
    assert online["final_per_seed"] == [curves["online"][s][1][-1] for s in range(5)]
    assert online["auc_per_seed"][0] == pytest.approx(curve_auc(*curves["online"][0]))
    assert online["vs_reference"] is None
    assert sparse["vs_reference"] == {"auc": "lower", "final": "lower"}
    assert hl["vs_reference"] == {"auc": "not resolved", "final": "not resolved"}
    assert online["wall_clock_s"]["mean"] == pytest.approx(102.0) and sparse["wall_clock_s"] is None


def test_summarize_higher_and_missing_reference():
    curves = make_curves({"online": 0.3, "offline": 0.9})
    assert summarize(curves, n_boot=200)["arms"]["offline"]["vs_reference"]["auc"] == "higher"
    no_ref = summarize(curves, reference_arm="absent", n_boot=200)
    assert all(stats["vs_reference"] is None for stats in no_ref["arms"].values())


def test_summarize_final_is_last_step_not_best():
    runs = {0: ([0, 10, 20], [0.2, 0.9, 0.5]), 1: ([0, 10, 20], [0.2, 0.8, 0.7])}
    stats = summarize({"online": runs}, n_boot=100)["arms"]["online"]
    assert stats["final_per_seed"] == [0.5, 0.7] and stats["final"]["mean"] == pytest.approx(0.6)


def test_summarize_step_mismatch_names_arm_and_seed():
    curves = make_curves({"online": 0.8, "sparse": 0.4})
    curves["sparse"][3] = ([0, 16, 32, 48, 80], curves["sparse"][3][1])
    with pytest.raises(ValueError, match=r"'sparse' seed 3"):
        summarize(curves, n_boot=100)


# ------------------------------------------------------------------------------------- band, table and plot


def test_pointwise_band():
    runs = {0: ([0, 10], [0.2, 0.4]), 1: ([0, 10], [0.4, 0.4]), 2: ([0, 10], [0.6, 0.4])}
    steps, mean, lo, hi = pointwise_band(runs, n_boot=300)
    assert steps == [0, 10]
    assert mean == pytest.approx([0.4, 0.4])
    assert lo[0] < 0.4 < hi[0] and lo[1] == pytest.approx(0.4) and hi[1] == pytest.approx(0.4)


def test_markdown_table():
    curves = make_curves({"online": 0.8, "sparse": 0.4, "humanline_k1": 0.8})
    summary = summarize(curves, wall_clock={"online": {s: 3600.4 for s in range(5)}}, n_boot=300)
    table = markdown_table(summary, labels={"online": "Online GRPO", "humanline_k1": "Humanline (k=1)"})
    lines = table.splitlines()
    assert lines[0].startswith("| arm | runs |") and "vs Online GRPO" in lines[0]
    assert lines[1] == "|---|---|---|---|---|---|"
    online_row = next(line for line in lines if line.startswith("| Online GRPO |"))
    assert "| — |" in online_row and "3600 [3600, 3600]" in online_row
    a = summary["arms"]["online"]["auc"]
    assert f"{a['mean']:.3f} [{a['lo']:.3f}, {a['hi']:.3f}]" in online_row
    assert any(line.startswith("| sparse | 5 |") and "lower / lower" in line for line in lines)
    assert any(line.startswith("| Humanline (k=1) |") and "not resolved / not resolved" in line for line in lines)
    assert lines[-1] == CI_NOTE


def test_plot_curves_writes_png(tmp_path):
    out = tmp_path / "nested" / "curves.png"
    plot_curves(make_curves({"online": 0.8, "sparse": 0.4}), out, labels={"online": "Online"}, title="t")
    data = out.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------- hierarchical bootstrap


def test_hierarchical_bootstrap_matches_plain_loop():
    """The documented draws (groups, then runs within each drawn group), recomputed with Python loops."""
    groups = [[0.1, 0.3], [0.5, 0.6, 0.9], [0.2]]
    n_boot, level, seed = 400, 0.9, 5
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(groups), size=(n_boot, len(groups)))
    within = rng.random((n_boot, len(groups), 3))
    means = []
    for b in range(n_boot):
        group_means = []
        for j, g in enumerate(drawn[b]):
            members = groups[g]
            picks = [members[int(math.floor(within[b, j, i] * len(members)))] for i in range(len(members))]
            group_means.append(sum(picks) / len(picks))
        means.append(sum(group_means) / len(group_means))
    lo, hi = np.quantile(means, [0.05, 0.95])
    ci = hierarchical_bootstrap_ci(groups, n_boot=n_boot, level=level, seed=seed)
    assert ci["mean"] == pytest.approx((0.2 + 2.0 / 3 + 0.2) / 3)  # the mean of the group means
    assert ci["lo"] == pytest.approx(lo) and ci["hi"] == pytest.approx(hi)
    assert ci["n"] == 6 and ci["groups"] == 3


def test_hierarchical_bootstrap_keeps_the_warmup_variance():
    """Runs that agree within each warm-up but not across warm-ups: a flat bootstrap over the 6 runs treats them
    as 6 independent draws and is too narrow; resampling warm-ups first widens the interval by about sqrt(2)."""
    groups = [[0.10, 0.11], [0.50, 0.51], [0.90, 0.91]]
    flat = bootstrap_ci([v for g in groups for v in g], n_boot=4000)
    nested = hierarchical_bootstrap_ci(groups, n_boot=4000)
    ratio = (nested["hi"] - nested["lo"]) / (flat["hi"] - flat["lo"])
    assert 1.2 < ratio < 1.7, ratio
    assert nested["mean"] == pytest.approx(flat["mean"])


def test_grouped_ci_keys():
    """Seeds alone are one group (the plain bootstrap); (warm-up, seed) keys are nested by warm-up."""
    by_seed = {0: 0.2, 1: 0.4, 2: 0.9}
    plain = grouped_ci(by_seed, n_boot=300)
    assert {k: plain[k] for k in ("mean", "lo", "hi", "n")} == bootstrap_ci([0.2, 0.4, 0.9], n_boot=300)
    nested = grouped_ci({(1, 0): 0.5, (0, 1): 0.2, (0, 0): 0.1, (1, 1): 0.7}, n_boot=300)
    assert nested == hierarchical_bootstrap_ci([[0.1, 0.2], [0.5, 0.7]], n_boot=300)
    with pytest.raises(ValueError):
        hierarchical_bootstrap_ci([[0.1], []])


def test_summarize_crossed_study():
    """A study keyed by (warm-up, seed): per-run lists in key order, keys as pairs in JSON, the table says
    how many warm-ups."""
    flat = make_curves({"online": 0.8, "offline": 0.3}, n_seeds=4)
    crossed = {arm: {(s // 2, s % 2): curve for s, curve in runs.items()} for arm, runs in flat.items()}
    summary = summarize(crossed, n_boot=300)
    online = summary["arms"]["online"]
    assert online["seeds"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert online["auc"]["groups"] == 2 and online["auc"]["n"] == 4
    assert online["auc_per_seed"] == [curve_auc(*flat["online"][s]) for s in range(4)]
    assert summary["arms"]["offline"]["vs_reference"] == {"auc": "lower", "final": "lower"}
    json.dumps(summary)
    assert "| 4 (2 warm-ups) |" in markdown_table(summary)
    steps, mean, lo, hi = pointwise_band(crossed["online"], n_boot=200)
    assert steps == STEPS and all(a <= m <= b for a, m, b in zip(lo, mean, hi))
