"""Held-out evaluation by reward (``eval.held_out``): an offline run sampled and scored like an online one, its
win rate against the first evaluation, the preference study's graded reward, and the recipe checks."""

from __future__ import annotations

import json

import pytest

from eval.repro.preference import digit_credit
from helpers import REPO, read_jsonl, run_recipe
from hl_core.rollout.heldout import win_rate
from launchers.run import main

OFFLINE_DPO = REPO / "recipes" / "repro" / "preference" / "dpo_offline.yaml"
TOY = ["model.name_or_path=tests/fixtures/toy_add/model", "model.random_init=true"]


def test_win_rate_hand_values():
    assert win_rate([1.0, 0.5, 0.0, 0.2], [0.5, 0.5, 1.0, 0.1]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert win_rate([0.3], [0.3]) == 0.5
    with pytest.raises(ValueError):
        win_rate([1.0], [1.0, 0.0])


def test_digit_credit_hand_values():
    prompts = [None] * 6
    completions = ["140", "149", "401", "1400", "14", " 1 4 0 "]
    assert digit_credit(prompts, completions, ["140"] * 6) == pytest.approx(
        [1.0, 2 / 3, 0.0, (3 - 0.5) / 3, (2 - 0.5) / 3, 1.0])
    assert digit_credit([None], ["073"], ["73"]) == [1.0]  # the reference is zero-padded to 3 digits
    with pytest.raises(ValueError):
        digit_credit([None], ["1"], [None])


def test_offline_run_evaluates_by_reward(tmp_path):
    """Offline DPO pairs, held-out prompts sampled and scored: the first evaluation's per-prompt scores are kept
    (their mean is the logged reward), its win rate against itself is exactly one half, and later evaluations
    report a win rate in [0, 1] and no offline loss."""
    out = tmp_path / "run"
    run_recipe(OFFLINE_DPO, [*TOY, "data.train.path=tests/fixtures/toy_add/pref_pairs_sample.jsonl",
                             "train.max_steps=4", "train.micro_batch_size=2", "eval.every=2", "data.eval.limit=16",
                             "train.lr=1e-2", f"output_dir={out}"])
    rows = read_jsonl(out / "eval.jsonl")
    assert [r["step"] for r in rows] == [0, 2, 4]
    start = json.loads((out / "heldout_start_rank00000.json").read_text())
    assert start["update"] == 0 and len(start["scores"]) == 16
    assert rows[0]["reward"] == pytest.approx(sum(start["scores"]) / 16)
    assert rows[0]["win_rate_vs_start"] == 0.5
    for row in rows:
        assert 0.0 <= row["win_rate_vs_start"] <= 1.0 and row["gen_len"] > 0
        assert "loss" not in row  # no offline loss: the eval split holds prompts


@pytest.mark.parametrize("recipe, overrides, needle", [
    (REPO / "recipes" / "repro" / "online.yaml", ["eval.held_out=loss"], "`eval.held_out: loss` cannot be used"),
    (OFFLINE_DPO, ["eval.held_out=reward", "data.eval=null", "data.eval_fraction=0.1",
                   "data.train.path=tests/fixtures/toy_add/pref_pairs_sample.jsonl"], "needs held-out prompts"),
])
def test_held_out_mode_checks(recipe, overrides, needle, capsys):
    assert main([str(recipe), "--validate", "model.name_or_path=tests/fixtures/toy_add/model", *overrides]) == 2
    assert needle in capsys.readouterr().err
