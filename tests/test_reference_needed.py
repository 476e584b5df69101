"""Runs that never read the reference build none: SFT, DPO's reference-free SimPO, and standard rollout GRPO without
a KL term; nor do runs whose reference log-probs the policy computes (look-ahead syncing, a cached frozen reference).
The rule (``hl_core.config.reference_needed``), the real engines that follow it, and the plan's memory."""

import json

import pytest

from helpers import REPO, run_torchrun
from hl_core.config import load_recipe, reference_needed

TINY = REPO / "recipes" / "tiny"
WARMUP = REPO / "recipes" / "repro" / "warmup.yaml"


@pytest.mark.parametrize("recipe, overrides, needed", [
    (WARMUP, [], False),                                                   # SFT
    (TINY / "online_grpo_math.yaml", ["objective.beta_kl=0"], False),      # ratio vs behaviour log-probs only
    (TINY / "online_grpo_math.yaml", ["objective.beta_kl=0.01"], True),    # the KL term reads it
    (TINY / "humanline_sparse_grpo_math.yaml", ["objective.beta_kl=0"], True),  # ratio vs the synced reference
    (TINY / "offline_grpo.yaml", ["objective.beta_kl=0"], True),           # offline: ratio vs the reference
    (TINY / "humanline_dpo.yaml", [], True),
    (TINY / "offline_kto.yaml", [], True),
    (TINY / "offline_dpo.yaml", ["objective.loss_type=simpo"], False),    # reference-free SimPO
    (TINY / "offline_dpo.yaml", ["objective.loss_type=ipo"], True),
])
def test_reference_needed_rule(recipe, overrides, needed):
    assert reference_needed(load_recipe(recipe, overrides)) is needed


def test_engines_build_the_reference_only_when_needed(tmp_path):
    grpo = TINY / "online_grpo_math.yaml"
    report = tmp_path / "report.json"
    run_torchrun(REPO / "tests" / "distributed" / "reference_presence.py", [
        report,
        f"ds_sft|{WARMUP}|",
        f"ds_grpo_no_kl|{grpo}|objective.beta_kl=0,engine.zero_stage=3",
        f"ds_grpo_kl|{grpo}|objective.beta_kl=0.01,engine.zero_stage=3",
        f"megatron_sft|{WARMUP}|engine.name=megatron",
        f"megatron_dpo|{TINY / 'megatron_humanline_dpo.yaml'}|parallel.tp=1,humanline.reference=copy",
        # the reference is read, but its log-probs come from the policy: look-ahead syncing, a cached frozen one
        f"ds_dpo_lookahead|{TINY / 'humanline_dpo.yaml'}|",
        f"megatron_dpo_lookahead|{TINY / 'megatron_humanline_dpo.yaml'}|parallel.tp=1",
        f"ds_kto_cached|{TINY / 'offline_kto.yaml'}|train.cache_reference_logps=true",
        f"ds_dpo_simpo|{TINY / 'offline_dpo.yaml'}|objective.loss_type=simpo",  # reference-free
    ], nproc=1)
    got = json.loads(report.read_text())
    for name in ("ds_sft", "ds_grpo_no_kl", "megatron_sft", "ds_dpo_lookahead", "megatron_dpo_lookahead",
                 "ds_kto_cached", "ds_dpo_simpo"):
        entry = got[name]
        assert entry["has_reference"] is False and entry["reference_built"] is False, (name, entry)
        assert "built no reference model" in entry["reference_logps_error"]
        assert "built no reference model" in entry["reference_sync_error"]
    for name in ("ds_grpo_kl", "megatron_dpo"):
        entry = got[name]
        assert entry["has_reference"] and entry["reference_built"] and entry["reference_params"] > 0, (name, entry)
        assert entry["reference_logps_error"] is None and entry["reference_sync_error"] is None
    assert all(entry["policy_logps_shape"] == [1, 4] for entry in got.values())


def test_plan_counts_no_reference_memory_when_none_is_built():
    from hl_core.preflight.plan import memory_plan

    recipe = REPO / "recipes" / "llama3_8b_online_grpo.yaml"
    without = memory_plan(load_recipe(recipe, ["objective.beta_kl=0"]), 8)
    with_kl = memory_plan(load_recipe(recipe, ["objective.beta_kl=0.01"]), 8)
    assert without["bytes"]["reference"] == 0 and with_kl["bytes"]["reference"] > 0
    gap = with_kl["bytes"]["total"] - without["bytes"]["total"]
    assert gap == pytest.approx(with_kl["bytes"]["reference"])
