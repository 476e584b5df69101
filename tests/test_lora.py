"""LoRA through PEFT (`model.lora`) on the real DeepSpeed engine, CPU, tiny model: training, syncing the adapter
only, the reference adapter's timing, no second model, `final/` loading with PEFT, resume, and config errors."""

import json
import math

import pytest

from helpers import REPO, run_recipe, run_worker

LORA = REPO / "recipes" / "tiny" / "humanline_dpo_lora.yaml"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora")
    run_worker(REPO / "tests/distributed/lora_harness.py", [out / "report.json", out])
    return json.loads((out / "report.json").read_text())


def test_synced_lora_copies_only_the_adapter_and_references_the_pre_update_adapter(report):
    assert report["reference_engine"] is False and report["has_reference"] is True  # no second model
    assert report["optimizer_is_policy_adapter"] and not report["reference_trainable"]
    records = report["records"]
    assert len(records) == 12
    for r in records:
        # the sync copies exactly the adapter's bytes: 10x fewer than the model holds here, far fewer at scale
        assert r["sync_bytes"] == report["adapter_bytes"] < report["model_bytes"] / 10
        assert r["ref_vs_policy"] == 0.0 and not r["reference_grads"]  # reference adapter == theta_n, no grads
        assert r["policy_moved"] > 1e-4  # the optimizer step changed the policy...
        assert r["next_ref_vs_pre_policy"] <= 1e-6  # ...and the next update's reference is the pre-update policy
    assert abs(report["synced_losses"][0] - math.log(2)) < 1e-6  # policy == reference at update 0


def test_lora_final_loads_with_peft_and_merged(report):
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
            "merged"} <= set(report["final_files"])
    assert report["final_peft_vs_policy"] < 1e-5 and report["final_merged_vs_policy"] < 1e-5


def test_frozen_lora_reference_is_the_base_model_and_the_loss_falls(report):
    assert report["frozen_reference_engine"] is False and report["frozen_has_reference"] is True
    assert report["frozen_pairs"] == 0  # nothing to sync
    assert report["frozen_extra_params"] == report["frozen_adapter_params"]  # base + one adapter, no second model
    assert report["frozen_ref_vs_base_before"] < 1e-5 and report["frozen_ref_vs_base_after"] < 1e-5
    assert report["frozen_policy_vs_base_after"] > 1e-2  # the policy moved, the reference did not
    losses = report["frozen_losses"]
    assert abs(losses[0] - math.log(2)) < 1e-6
    assert sum(losses[-4:]) / 4 < losses[0] - 0.02, losses


def test_lora_resume_reproduces_the_uninterrupted_run(report):
    assert report["resume_reference_files"] == ["reference_rank00000.pt"]  # the reference adapter is kept
    assert report["resume_checkpoint_bytes"] < 400_000  # the frozen base (656 KB in fp32 here) is not saved
    whole, resumed = report["resume_whole"], report["resume_split"]
    assert [step for step, _ in resumed] == list(range(6))
    for (step, a), (_, b) in zip(whole, resumed):
        assert abs(a - b) < 1e-6, (step, a, b)


def test_lora_config_errors(tmp_path):
    proc = run_recipe(LORA, ["--validate", "engine.name=megatron", f"output_dir={tmp_path}"], expect=2)
    assert "`model.lora`" in proc.stderr and "megatron engine has no LoRA" in proc.stderr
    proc = run_recipe(LORA, ["model.lora.target_modules=[nope_proj]", f"output_dir={tmp_path}"], expect=2)
    assert "`model.lora.target_modules" in proc.stderr and "q_proj" in proc.stderr


def test_lora_off_by_r_null_zero3_refused_and_post_training_evals_need_the_merged_model():
    from hl_core.config import load_recipe
    from hl_core.config.checks import check_lora
    from hl_core.errors import RecipeError

    assert not load_recipe(LORA, ["model.lora.r=null"]).model.lora_enabled
    zero3 = load_recipe(LORA, ["engine.zero_stage=3"])
    with pytest.raises(RecipeError, match="engine.zero_stage=2"):
        check_lora(zero3.model, zero3.engine, zero3.eval)
    recipe = load_recipe(LORA, ["model.lora.save_merged=false", "eval.data_quality.enabled=true"])
    with pytest.raises(RecipeError, match="save_merged=true"):
        check_lora(recipe.model, recipe.engine, recipe.eval)


@pytest.mark.parametrize("targets", [None, "[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
                                     "all-linear", "'.*mlp\\.(up|down)_proj'", "[lm_head, embed_tokens]"])
def test_plan_counts_the_adapter_peft_builds(targets):
    from peft import get_peft_model

    from hl_core.config import load_recipe, run_shape
    from hl_core.engines.lora import lora_config
    from hl_core.models.loading import build_causal_lm
    from hl_core.preflight.plan import memory_plan

    target = "null" if targets is None else targets
    recipe = load_recipe(LORA, [f"model.lora.target_modules={target}", "humanline.reference=copy"])
    model = get_peft_model(build_causal_lm(recipe.model, "fp32", 0), lora_config(recipe.model.lora))
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters()) - adapter
    plan = memory_plan(run_shape(recipe), 1)
    assert plan["lora_adapter_params"] == plan["trainable_params"] == adapter and plan["params"] == base
    b = plan["bytes"]  # fp32 ZeRO-0: weights 4 (P + A), gradients 4A, AdamW moments 8A, the reference adapter 4A
    assert (b["weights"], b["gradients"], b["optimizer"], b["reference"]) == (4 * (base + adapter), 4 * adapter,
                                                                            8 * adapter, 4 * adapter)
    frozen = memory_plan(run_shape(load_recipe(LORA, [f"model.lora.target_modules={target}",
                                                      "humanline.sync_every=null"])), 1)
    assert frozen["bytes"]["reference"] == 0
    lookahead = memory_plan(run_shape(load_recipe(LORA, [f"model.lora.target_modules={target}"])), 1)  # no adapter copy
    assert lookahead["bytes"]["reference"] == 0
    full = memory_plan(run_shape(load_recipe(LORA, ["model.lora.r=null", "humanline.reference=copy"])), 1)
    assert full["bytes"]["reference"] == 4 * base and full["bytes"]["optimizer"] == 8 * base
