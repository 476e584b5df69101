"""The fair preference study (`python -m eval.repro --study preference_fair`) on its shortened grid: each arm tunes
its own learning rate and max grad norm on tuning seeds kept apart from the reported seeds, by the rule fixed in
code; humanline runs at several sync periods and clamp bounds; offline data comes from three sources with their
pair distance reported; the same seed gives the same curve; and one humanline DPO run is pinned. The full grid's
plan (run count, ETA) is checked against the 60-minute budget without running it."""

import json
import statistics
from pathlib import Path

import pytest

from eval.repro import fair
from eval.repro.studies import FULL, QUICK
from helpers import pinned_for_these_kernels, run_study

REPO = Path(__file__).resolve().parents[1]
PIN = REPO / "tests" / "fixtures" / "repro_fair_quick_pin.json"


@pytest.fixture(scope="module")
def quick(tmp_path_factory, repro_cache, repro_pool):
    out = tmp_path_factory.mktemp("repro-fair") / "quick"
    proc = run_study(["--study", "preference_fair", "--quick", "--out", out, "--cache", repro_cache], repro_pool)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text()), proc.stdout


def test_plan_is_printed_before_any_run(quick):
    _, result, stdout = quick
    plan_line = next(line for line in stdout.splitlines() if line.startswith("plan: "))
    assert stdout.index(plan_line) < stdout.index("warmup 0")  # before the warm-ups and every run
    planned = result["plan"]["tuning_runs"] + result["plan"]["reported_runs_at_most"]
    assert f"plan: {planned} runs at most" in plan_line and "ETA" in plan_line
    assert len(result["tuning_runs"]) == result["plan"]["tuning_runs"]
    assert len(result["runs"]) <= result["plan"]["reported_runs_at_most"]


def test_each_arm_tuned_on_its_own_grid_by_the_fixed_rule(quick):
    """Online over its learning rates; humanline and offline over the multipliers x online's choice; then each
    arm's max grad norm at its learning rate; the choice is the largest mean tuning AUC, recomputed here from the
    tuning runs themselves; tuning runs use only the tuning seeds."""
    _, result, _ = quick
    design = result["design"]
    assert not set(design["tuning_seeds"]) & set(design["reported_seeds"])
    assert {r["seed"] for r in result["tuning_runs"]} == set(design["tuning_seeds"])
    assert {r["seed"] for r in result["runs"]} == set(design["reported_seeds"])
    groups = {(g["arm"], g["knob"]): g for g in result["tuning"]}
    assert set(groups) == {(a, k) for a in ("online", "humanline", "offline") for k in ("lr", "max_grad_norm")}
    assert [c["lr"] for c in groups[("online", "lr")]["candidates"]] == design["online_lrs"]
    online_lr = next(c["lr"] for c in groups[("online", "lr")]["candidates"]
                     if c["arm"] == groups[("online", "lr")]["chosen"])
    for kind in ("humanline", "offline"):
        lrs = [c["lr"] for c in groups[(kind, "lr")]["candidates"]]
        assert lrs == pytest.approx([online_lr * m for m in design["multipliers"]], rel=1e-2)
    by_arm = {}
    for run in result["tuning_runs"]:
        by_arm.setdefault(run["arm"], []).append(fair_auc(run))
    for group in result["tuning"]:
        assert [c["max_grad_norm"] for c in group["candidates"]] == (design["norms"] if group["knob"] ==
                                                                     "max_grad_norm" else [design["norms"][0]] *
                                                                     len(group["candidates"]))
        means = [statistics.fmean(by_arm[c["arm"]]) for c in group["candidates"]]
        assert group["chosen"] == group["candidates"][means.index(max(means))]["arm"]
    for kind in ("online", "humanline", "offline"):
        assert result["chosen"][f"dpo_{kind}"]["arm"] == groups[(kind, "max_grad_norm")]["chosen"]


def fair_auc(run: dict) -> float:
    from eval.repro.stats import curve_auc

    return curve_auc(run["steps"], run["values"])


def test_select_takes_the_largest_mean_auc_and_the_earlier_on_a_tie():
    a, b, c = (fair.Setting("dpo", "online", lr) for lr in (1e-5, 1e-4, 4e-4))
    assert fair.select([a, b, c], {a: [0.1, 0.3], b: [0.25, 0.25], c: [0.2, 0.2]}) == b
    assert fair.select([a, b, c], {a: [0.2], b: [0.2], c: [0.1]}) == a


def test_reported_roles_sync_periods_sources_and_bounds(quick):
    _, result, _ = quick
    roles = result["roles"]["dpo"]
    chosen = {k: v["arm"] for k, v in result["chosen"].items()}
    assert roles["online"] == chosen["dpo_online"] and roles["humanline"] == chosen["dpo_humanline"]
    online = result["chosen"]["dpo_online"]
    assert roles["humanline@online"].endswith(f"@lr{online['lr']:g}" + ("" if online["max_grad_norm"] == 1.0 else
                                                                           f",norm{online['max_grad_norm']:g}"))
    assert [row["k"] for row in result["sync_periods"]] == [1, 4]
    for arm in roles.values():
        assert len([r for r in result["runs"] if r["arm"] == arm]) == len(result["warmups"]) * len(result["seeds"])
    k4 = next(r for r in result["runs"] if r["arm"] == roles["humanline k=4"])
    assert "humanline.sync_every=4" in k4["overrides"]
    clip = next(r for r in result["runs"] if r["arm"] == roles["humanline clip -0.1/1"])
    assert "humanline.log_eps_P=-0.1" in clip["overrides"] and "humanline.log_eps_R=1" in clip["overrides"]


def test_three_sources_with_pair_distance_and_chosen_against_the_start(quick):
    """Weak, strong and mixture data, each with its pair distance and chosen reward relative to the start policy;
    the stronger writer's samples score above the weak writer's; the mixture's pairs come from its 4 writers."""
    _, result, _ = quick
    sources = result["sources_table"]
    assert list(sources) == ["weak", "strong", "mixture"]
    for s in sources.values():
        assert s["pairs"] > 0 and s["pair_distance_mean"] == pytest.approx(s["chosen_reward_mean"] -
                                                                           s["rejected_reward_mean"])
        assert s["chosen_minus_start"] == pytest.approx(s["chosen_reward_mean"] - s["start_policy_reward"])
    assert sources["strong"]["sample_reward_mean"] > sources["weak"]["sample_reward_mean"]
    assert len(sources["mixture"]["writers"]) == 4
    assert sum(w["chosen"] for w in sources["mixture"]["writers"]) == sources["mixture"]["pairs"]
    roles = result["roles"]["dpo"]
    paths = {name: next(o for r in result["runs"] if r["arm"] == roles[role] for o in r["overrides"]
                        if o.startswith("data.train.path="))
             for name, role in (("weak", "offline"), ("strong", "offline strong"), ("mixture", "humanline mixture"))}
    assert len(set(paths.values())) == 3


def test_clamp_binding_is_reported_per_arm(quick):
    _, result, _ = quick
    rows = {row["role"]: row for row in result["clamp"]}
    assert {"online", "offline", "humanline", "humanline clip -0.1/1"} <= set(rows)
    for role in ("humanline", "humanline clip -0.1/1"):
        assert 0.0 <= rows[role]["clamp_binding"] <= 1.0
    assert rows["humanline clip -0.1/1"]["minus_humanline_auc"]["verdict"] in ("higher", "lower", "not resolved")


def test_sanity_checks_and_result_files(quick):
    out, result, _ = quick
    assert result["sanity"] == {"online_rollout_every_update": True, "offline_never_generates": True,
                                "offline_data_unchanged": True, "same_seed_same_curve": True,
                                "same_seed_same_losses": True}
    for entry in result["summary"]["arms"].values():
        assert entry["auc"]["lo"] <= entry["auc"]["mean"] <= entry["auc"]["hi"]
        assert entry["auc"]["groups"] == len(result["warmups"]) == 2
    markdown = (out / "results.md").read_text()
    for heading in ("## Tuning", "## Does humanline close the gap?", "## Sync period", "## Offline data sources",
                    "## Where the clamp binds", "Runtime:"):
        assert heading in markdown
    assert (out / "curves.png").stat().st_size > 1000


def test_pinned_humanline_dpo_curve(quick, tmp_path):
    """The quick grid's tuned offline humanline DPO run (warm-up 0, seed 0), warm-ups, data writers and tuning
    included, against values stored from an earlier commit: its learning rate and max grad norm (the tuning's
    choice, in the arm's name), held-out reward within 2/64 per evaluation, every update's loss and update 0's
    gradient norm to 1e-3 relative (offline DPO samples nothing while training, so the losses are exact here).
    Compared with the pin of the machine whose CPU kernels compute the same bytes (`helpers.pinned_for_these_kernels`:
    skipped, with the way to pin it, on a machine whose kernels differ from every pinned one's)."""
    _, result, _ = quick
    arm = result["roles"]["dpo"]["humanline"]
    run = next(r for r in result["runs"] if r["arm"] == arm and r["warmup"] == 0 and r["seed"] == 0)
    actual = {"arm": arm, "steps": run["steps"], "reward": run["values"], "losses": run["losses"],
              "first_grad_norm": run["grad_norms"][0]}
    pinned, hint = pinned_for_these_kernels(PIN, actual, result["environment"]["kernel_fingerprint"], tmp_path)
    assert actual["arm"] == pinned["arm"] and actual["steps"] == pinned["steps"], hint
    assert actual["reward"] == pytest.approx(pinned["reward"], abs=2 / 64 + 1e-9), hint
    assert actual["losses"] == pytest.approx(pinned["losses"], rel=1e-3), hint
    assert actual["first_grad_norm"] == pytest.approx(pinned["first_grad_norm"], rel=1e-3), hint


def test_full_plan_fits_the_hour(tmp_path, capsys):
    """`--plan` prints the full grid's run count and ETA (from docs/repro/preference.json's per-run times, the
    data writers' warm-ups included when not cached) and runs nothing; the design keeps it under 60 minutes on
    2 cores."""
    from eval.repro.__main__ import cli

    assert cli(["--study", "preference_fair", "--plan", "--jobs", "2", "--cache", str(tmp_path / "cache"),
                "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "plan: " in text and "ETA" in text
    _, plan = fair.plan_text(fair.FULL_FAIR, FULL, FULL.warmups, list(range(FULL.seeds)), 2, tmp_path / "cache")
    assert plan["writers_to_train"] == 4  # weak, strong and the mixture's two others
    assert plan["tuning_runs"] == 2 * 3 * (5 + 1) * 1  # DPO and KTO, 3 arms x 6 settings, 1 warm-up x 1 seed
    assert plan["eta_s"] < 60 * 60
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()
    _, quick_plan = fair.plan_text(fair.QUICK_FAIR, QUICK, QUICK.warmups, [0], 2, tmp_path / "cache")
    assert quick_plan["tuning_runs"] < plan["tuning_runs"]


def test_reported_seeds_must_stay_apart_from_tuning_seeds(tmp_path, capsys):
    from eval.repro.__main__ import cli

    assert cli(["--study", "preference_fair", "--seeds", "101", "--out", str(tmp_path / "out"), "--plan"]) == 2
    assert "tuning seeds" in capsys.readouterr().err
