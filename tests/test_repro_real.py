"""The real-model study's driver (``python -m eval.repro --study real``, eval/repro/real.py): its plan, arms and
resume logic without a model; the offline set's construction on the tiny model (the same prompts and samples per
prompt as the online arm draws, its update-0 groups the online arm's own); the report's numbers are the JSON's, and
the gap share and its interval by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from eval.repro import __main__ as driver, real, real_report
from helpers import REPO, read_jsonl, run_recipe

DOCS = REPO / "docs" / "results" / "real-study"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "eval.repro", "--study", "real", *args], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300)


# ------------------------------------------------------------------------------------------------ plan and arms
def test_plan_lists_the_arms_the_seeds_and_an_eta(tmp_path):
    proc = _cli("--plan", "--arms", "offline", "online", "--seeds", "2", "--out", str(tmp_path / "out"),
                "--cache", str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr
    assert ("plan: 4 cells (0 finished, skipped; 4 to run) and 2 offline set(s) to sample (not cached); 12 updates"
            in proc.stdout)
    assert "offline              seeds [0, 1]: 2 to run [0, 1]" in proc.stdout and "ETA " in proc.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # a plan runs and writes nothing


@pytest.mark.parametrize("args, message", [(["--arms", "offline", "nope"], "unknown arm(s) or regime(s) nope"),
                                           (["--warmups", "2"], "has no warm-ups")])
def test_bad_arguments_exit_2(tmp_path, args, message):
    proc = _cli("--plan", "--out", str(tmp_path), *args)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_core_arms_run_first_seed_by_seed():
    cells = real.plan_cells([real.ARM[n] for n in ("online_humanline", "online", "offline")], [0, 1])
    assert [(a.name, s) for a, s in cells] == [("online", 0), ("offline", 0), ("online", 1), ("offline", 1),
                                              ("online_humanline", 0), ("online_humanline", 1)]


def test_offline_arms_replay_the_seeds_set_and_online_arms_log_their_samples():
    grid = real.FULL_REAL
    offline = real.cell_overrides(real.ARM["offline_humanline"], grid, 1)
    online = real.cell_overrides(real.ARM["online"], grid, 1)
    assert "rollout.every=12" in offline and "train.seed=1" in offline and "rollout.log_samples=true" in online
    assert {"train.deterministic=true", "train.num_threads=1"} <= set(offline) & set(online)
    # the seed's set decides an offline cell's key; an online cell's key does not read it
    assert real.cell_key(real.ARM["offline"], grid, 1) != real.cell_key(real.ARM["offline"], grid, 2)
    assert real.set_key(grid, 0) != real.set_key(grid, 1)


def test_a_cells_key_reads_values_not_comments(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "REPO", tmp_path)
    (tmp_path / "recipes" / "real" / "data").mkdir(parents=True)
    data = tmp_path / "recipes" / "real" / "data" / "a.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n')
    base, arm = tmp_path / "base.yaml", tmp_path / "arm.yaml"
    base.write_text("train:\n  lr: 1.0\n")
    arm.write_text("defaults: [base.yaml]\nrollout:\n  every: 2\n")
    key = real.content_key(arm, ["train.seed=1"])
    base.write_text("# a comment\ntrain:\n  lr: 1.0  # the same value\n")
    assert real.content_key(arm, ["train.seed=1"]) == key
    base.write_text("train:\n  lr: 2.0\n")
    assert real.content_key(arm, ["train.seed=1"]) != key
    base.write_text("train:\n  lr: 1.0\n")
    data.write_text("{}\n")
    assert real.content_key(arm, ["train.seed=1"]) != key
    assert real.content_key(arm, ["train.seed=2"]) != real.content_key(arm, ["train.seed=1"])


def _record(arm, seed, end, key=None):
    steps = [0, 4, 8, 12]
    values = [0.0, end / 3, end / 2, end]
    entry = {"arm": arm, "seed": seed, "key": key or real.cell_key(real.ARM[arm], real.FULL_REAL, seed),
             "steps": steps, "held_out": values, "held_out_start": 0.0, "held_out_end": end, "greedy_right_sum": 10,
             "wall_s": 100.0, "cpu_s": 90.0, "rollout_wall_s": 30.0, "rollout_cpu_s": 25.0, "update_wall_s": 50.0,
             "update_cpu_s": 45.0, "other_wall_s": 20.0, "other_cpu_s": 20.0, "greedy_wall_s": 5.0,
             "greedy_cpu_s": 5.0, "torch_threads": 1, "deterministic": True, "ratio_mean": [1.0] * 12,
             "rollout_updates": [0] if real.ARM[arm].offline else list(range(12)), "git_commit": "abc"}
    if real.ARM[arm].offline:
        entry["offline_set"] = real.set_key(real.FULL_REAL, seed)
    return entry


class _Pool:
    jobs = 1


def test_a_rerun_skips_the_finished_cells(tmp_path, monkeypatch):
    calls = []

    def cell(arm, seed, grid, cache, pool, sets):
        calls.append((arm.name, seed))
        assert not arm.offline or seed in sets
        return _record(arm.name, seed, 0.1 * (seed + 1))

    def offline_set(grid, seed, cache, pool):
        calls.append(("set", seed))
        return tmp_path / "rollouts", {"seed": seed, "key": real.set_key(grid, seed), "sha256": {"x": "1"},
                                       "groups": 48, "samples_per_group": [8], "score_mean": 0.0,
                                       "generation_wall_s": 60.0, "generation_cpu_s": 50.0}

    monkeypatch.setattr(real, "run_cell", cell)
    monkeypatch.setattr(real, "offline_set", offline_set)
    monkeypatch.setattr(real, "set_digests", lambda rollouts: [])
    monkeypatch.setattr(real, "environment", lambda pool: {"git_commit": "abc"})
    out = tmp_path / "out"
    argv = ["--study", "real", "--arms", "online", "offline", "--seeds", "2", "--out", str(out)]
    assert driver.main(argv, pool=_Pool()) == 0
    assert calls == [("online", 0), ("set", 0), ("offline", 0), ("online", 1), ("set", 1), ("offline", 1)]
    first = json.loads((out / "results.json").read_text())
    assert [(r["arm"], r["seed"]) for r in first["runs"]] == [("offline", 0), ("offline", 1), ("online", 0),
                                                             ("online", 1)]
    calls.clear()
    assert driver.main(argv, pool=_Pool()) == 0
    assert calls == []  # every cell finished: nothing runs again
    # a third seed runs only its own cells; a cell whose key changed (another recipe, data or override) runs again
    stale = json.loads((out / "results.json").read_text())
    stale["runs"][0]["key"] = "changed"
    (out / "results.json").write_text(json.dumps(stale))
    assert driver.main([*argv[:-3], "3", "--out", str(out)], pool=_Pool()) == 0
    assert calls == [("set", 0), ("offline", 0), ("online", 2), ("set", 2), ("offline", 2)]
    assert len(json.loads((out / "results.json").read_text())["runs"]) == 6


# ------------------------------------------------------------------------------------------------ the offline set
def test_the_offline_set_holds_what_the_online_arm_samples(tmp_path):
    """The set (sampled at update 0 by the pack's own rollout code) holds the prompts at the data positions the
    online arm samples at each update, with as many samples; its update-0 groups are the online arm's, token for
    token (both from the initial policy, per-prompt seeds)."""
    recipe = REPO / "recipes" / "tiny" / "online_grpo_math.yaml"
    common = ["train.max_steps=3", "train.micro_batch_size=2", "rollout.num_generations=4", "train.seed=3",
              "eval.every=null", "checkpoint.save_final=false", "rollout.reward.kind=callable",
              "rollout.reward.function=eval.addition:sum_credit"]  # graded by length: the online policy moves
    online = tmp_path / "online"
    run_recipe(recipe, [*common, f"output_dir={online}", "rollout.every=1", "rollout.log_samples=true",
                        "train.lr=1e-2"])
    code = ("import json, sys; from eval.repro.real import write_offline_set; "
            "print(json.dumps(write_offline_set(sys.argv[1], sys.argv[2:-1], sys.argv[-1])))")
    proc = subprocess.run([sys.executable, "-c", code, str(recipe), *common, "rollout.every=3", str(tmp_path / "set")],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(proc.stdout.strip().splitlines()[-1])
    sampled = read_jsonl(online / "rollouts" / "rank00000.jsonl")
    kept = read_jsonl(tmp_path / "set" / "rollouts" / "rank00000.jsonl")
    assert meta["groups"] == len(kept) == len(sampled) == 3 * 2 and meta["samples_per_group"] == [4]
    assert meta["generation_wall_s"] > 0 and meta["generation_cpu_s"] > 0
    assert not (tmp_path / "set.partial").exists()

    def cells(rows):
        return sorted((r["train_step"], r["position"], json.dumps(r["prompt"]), len(r["completion_ids"]))
                      for r in rows)

    assert cells(kept) == cells(sampled)
    first = {r["position"]: (r["completion_ids"], r["scores"]) for r in sampled if r["train_step"] == 0}
    assert {r["position"]: (r["completion_ids"], r["scores"]) for r in kept if r["train_step"] == 0} == first
    # later updates: the online arm sampled from a policy that had moved, the set from the initial one
    later = {(r["train_step"], r["position"]): r["completion_ids"] for r in sampled if r["train_step"] > 0}
    assert any(later[(r["train_step"], r["position"])] != r["completion_ids"] for r in kept if r["train_step"] > 0)
    assert all(r["rollout_step"] == 0 for r in kept)


# ------------------------------------------------------------------------------------------------ the report
def test_gap_share_and_its_interval_by_hand():
    by_seed = {"online": {0: 0.3, 1: 0.5, 2: 0.4}, "offline": {0: 0.1, 1: 0.1, 2: 0.2},
               "offline_humanline": {0: 0.2, 1: 0.3, 2: 0.3}}
    g = real_report.gap_share(by_seed, "offline_humanline", n_boot=2000, seed=5)
    assert g["share"] == pytest.approx((0.1 + 0.2 + 0.1) / (0.2 + 0.4 + 0.2))
    assert g["gap"]["mean"] == pytest.approx(0.8 / 3) and g["closed"]["mean"] == pytest.approx(0.4 / 3)
    rng = np.random.default_rng(5)  # the paired resampling, written out as a loop
    ratios = []
    for draw in rng.integers(0, 3, size=(2000, 3)):
        gap = sum(by_seed["online"][s] - by_seed["offline"][s] for s in draw)
        ratios.append(sum(by_seed["offline_humanline"][s] - by_seed["offline"][s] for s in draw) / gap)
    assert (g["share_lo"], g["share_hi"]) == pytest.approx(tuple(np.quantile(ratios, [0.025, 0.975])))
    assert g["gap_resolved"] is True
    assert real_report.gap_share({"online": {0: 1.0}, "offline": {1: 0.0}, "x": {0: 1.0}}, "x") is None


def test_the_markdown_holds_the_jsons_numbers(tmp_path):
    runs = [_record(a, s, e) for a, ends in (("offline", (0.1, 0.0, 0.2)), ("online", (0.3, 0.5, 0.4)),
                                             ("offline_humanline", (0.2, 0.3, 0.3))) for s, e in enumerate(ends)]
    results = real_report.write_report(tmp_path, {"title": "t", "runs": runs, "offline_sets": []}, real.LABELS)
    text = (tmp_path / "results.md").read_text()
    assert json.loads((tmp_path / "results.json").read_text())["summary"] == results["summary"]
    end = results["summary"]["arms"]["online"]["held_out_end"]
    assert end["mean"] == pytest.approx(0.4)
    assert f"{end['mean']:.3f} [{end['lo']:.3f}, {end['hi']:.3f}]" in text
    share = results["summary"]["gap_share"]["offline_humanline"]
    assert f"{share['share']:.2f} [{share['share_lo']:.2f}, {share['share_hi']:.2f}]" in text
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_committed_report_is_its_json():
    results = json.loads((DOCS / "results.json").read_text())
    assert results["summary"] == json.loads(json.dumps(real_report.summarize(results)))
    assert (DOCS / "results.md").read_text() == real_report.render(results, real.LABELS)
    for run in results["runs"]:  # the fields, in every cell
        assert {"arm", "seed", "held_out_start", "held_out_end", "greedy_right_sum", "wall_s", "cpu_s",
                "rollout_wall_s", "update_wall_s"} <= set(run)
        assert run["held_out_start"] == run["held_out"][0] and run["held_out_end"] == run["held_out"][-1]


def test_the_results_page_quotes_the_report():
    """Every results and cost row on the page is a row of the generated report (so the JSON's numbers)."""
    page = (REPO / "docs" / "results" / "real-study.md").read_text()
    report = (DOCS / "results.md").read_text().splitlines()
    rows = [line for line in page.splitlines() if line.startswith("| ") and any(
        label in line for label in real.LABELS.values())]
    assert len(rows) >= 2 * len({r["arm"] for r in json.loads((DOCS / "results.json").read_text())["runs"]})
    assert [row for row in rows if row not in report] == []


def test_the_readmes_comparison_is_the_jsons():
    """The README's two sentences quote the committed study: the share of the gap closed with its interval, and the
    three core arms' mean final held-out reward."""
    import re

    summary = json.loads((DOCS / "results.json").read_text())["summary"]
    share = summary["gap_share"]["offline_humanline"]
    text = " ".join((REPO / "README.md").read_text().split())
    assert f"closed {share['share']:.2f} [{share['share_lo']:.2f}, {share['share_hi']:.2f}]" in text
    ends = [summary["arms"][arm]["held_out_end"]["mean"] for arm in ("offline", "offline_humanline", "online")]
    quoted = re.search(r"final held-out reward (-?\d\.\d+), (-?\d\.\d+) and (-?\d\.\d+)", text)
    assert quoted and [float(v) for v in quoted.groups()] == [round(e, 3) for e in ends], quoted
