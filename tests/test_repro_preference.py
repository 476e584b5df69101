"""The preference study's built-in sanity checks on its shortened grid (`python -m eval.repro --study preference
--quick`): online pairs come from the current policy (a rollout every update), offline arms never generate and
their data never changes, the offline data comes from a different (weaker) model, the same seed gives the same
curve twice, and the win rate against the start policy starts at one half."""

import json

import pytest

from helpers import run_study


@pytest.fixture(scope="module")
def quick(tmp_path_factory, repro_cache, repro_pool):
    out = tmp_path_factory.mktemp("repro-preference") / "quick"
    proc = run_study(["--study", "preference", "--quick", "--out", out, "--cache", repro_cache], repro_pool)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_sanity_checks(quick):
    _, result = quick
    assert result["sanity"] == {"online_rollout_every_update": True, "offline_never_generates": True,
                                "offline_data_unchanged": True, "same_seed_same_curve": True,
                                "same_seed_same_losses": True}


def test_offline_data_from_a_weaker_model(quick):
    """Best vs worst of the weaker model's samples: chosen beats rejected on average, and the weaker model's
    samples score below the warm-up policy's held-out samples at update 0."""
    _, result = quick
    meta = result["offline_data"]
    assert meta["pairs"] > 0 and meta["chosen_reward_mean"] > meta["rejected_reward_mean"]
    start = [r["values"][0] for r in result["runs"]]
    assert meta["sample_reward_mean"] < sum(start) / len(start)
    assert "weak-model" in meta["model"]


def test_arms_verdicts_and_win_rates(quick):
    out, result = quick
    arms = result["summary"]["arms"]
    assert set(arms) == {"dpo_offline", "dpo_online", "dpo_offline_humanline", "kto_online", "grpo_offline"}
    assert arms["dpo_offline"]["reference"] == "dpo_online" and arms["dpo_offline"]["vs_reference"] is not None
    assert arms["grpo_offline"]["vs_reference"] is None  # its online arm is not in the quick grid
    for run in result["runs"]:
        assert run["win_rate"][0] == 0.5 and len(run["win_rate"]) == len(run["steps"])
    assert set(result["win_rate_summary"]["arms"]) == set(arms)
    markdown = (out / "results.md").read_text()
    assert "Win rate against the start policy" in markdown and "offline humanline DPO" in markdown
