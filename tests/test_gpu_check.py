"""bench/gpu_check.py on a machine without a GPU: a clear refusal without --dry-run, every section through
the real engines at toy size with --dry-run (TRL's DPOTrainer too, when trl is installed; the Liger and compiled runs
skip with their reasons), and the FLOP count behind its MFU against torch's own counter."""

import json

import pytest
import torch

from bench.gpu_check import SECTIONS, main, missing_package  # noqa: E402
from bench.gpu_check_runs import COMPARED, NO_DRY_RUN, plan_runs  # noqa: E402
from bench.shapes import forward_flops_per_token, spec_of, write_model_dir  # noqa: E402
from helpers import REPO, run_fresh

CHECK = REPO / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_without_a_gpu_it_exits_2_with_one_line(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "r.jsonl")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0] and "--dry-run" in lines[0]
    assert not (tmp_path / "r.jsonl").exists()


def test_dry_run_exercises_every_section(tmp_path):
    out, table = tmp_path / "r.jsonl", tmp_path / "r.md"
    proc = run_fresh([CHECK, "--dry-run", "--out", out, "--markdown", table], timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    env, results = rows[0], rows[1:]
    assert env["kind"] == "environment" and env["dry_run"] and len(env["source_sha256"]) == 16
    runs = {r["id"]: r for r in results if r.get("kind") not in ("comparison", "ratio")}
    planned = {r["id"]: r for r in plan_runs(tmp_path / "plan", dry_run=True, sections=list(SECTIONS))}
    assert set(runs) == set(planned)
    assert {r["section"] for r in runs.values()} == set(SECTIONS)
    for run_id, r in runs.items():
        assert "error" not in r, r
        if "skipped" in r:  # an optional package that is not installed here, or a run a dry run leaves out
            plan = planned[run_id]
            assert r["skipped"] == (missing_package(plan) or NO_DRY_RUN[plan["no_dry_run"]]), r
            continue
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["losses"], r
        if r["engine"] == "trl":
            continue
        assert r["plan_gib"]["total"] > r["plan_gib"]["steady"] > 0
        humanline = "hl_" in run_id
        assert (r["sync_frac"] > 0) == humanline, r  # syncing runs sync, the others never
    assert {i for i, r in runs.items() if "skipped" in r} >= {"ds_z2_hl_dpo_compile",
                                                              "ds_z2_dpo_fast"}  # compile: minutes
    assert runs["mg_hl_dpo_bf16"]["engine"] == "megatron" and runs["ds_z3_hl_dpo_gc"]["gradient_checkpointing"]
    online = runs["ds_online_grpo"]
    assert online["gen_rows"] == 4 and online["gen_new_tokens"] > 0 and 0 < online["rollout_share"] < 1
    assert online["gen_kv_cache"] == "dynamic" and online["gen_static_same_samples"]  # the static cache: same samples
    assert online["gen_tokens_per_s_static"] > 0 and online["gen_tokens_per_s_dynamic"] > 0
    comparisons = {r["id"]: r for r in results if r.get("kind") == "comparison"}
    assert set(comparisons) == {f"{a}_vs_{b}" for a, b, _, _ in COMPARED}
    fp32 = comparisons["mg_hl_dpo_fp32_vs_ds_z0_hl_dpo_fp32"]
    assert fp32["updates"] == 3 and fp32["within_tolerance"] and fp32["max_abs_loss_diff"] < 1e-4
    assert len(set(fp32["losses"])) == 3  # the weights moved: the comparison is not of three equal numbers
    ratios = {r["id"]: r for r in results if r.get("kind") == "ratio"}
    assert ratios["ds_z2_hl_dpo_fused_vs_ds_z2_hl_dpo"]["max_abs_loss_diff"] < 1e-2  # bf16: the same losses, nearly
    assert ratios["ds_z2_hl_dpo_mix_packed_vs_ds_z2_hl_dpo_mix_padded"]["tokens_per_s_ratio"] > 0
    if "skipped" not in runs["trl_dpo"]:
        best = ratios["ours_best_dpo_vs_trl_best_dpo"]
        assert best["against"] == "trl_dpo" and best["run"] == "ds_z2_dpo" and best["tokens_per_s_ratio"] > 0
    text = table.read_text()
    assert all(r["title"] in text for r in runs.values()) and "noise floor" in text


def test_flops_per_token_equal_torch_flop_counter(tmp_path):
    """Our FLOP formula against torch's FlopCounterMode on a Llama-family model with eager attention
    (which computes the full score matrix, as the formula's convention counts it)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = spec_of("llama3.2-1b", num_layers=2, hidden_size=64, intermediate_size=160, num_heads=4, num_kv_heads=2,
                   head_dim=16, vocab_size=300, tie_word_embeddings=False)
    config = AutoConfig.from_pretrained(write_model_dir(spec, tmp_path / "m"))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    batch, seq = 3, 40
    ids = torch.randint(0, 300, (batch, seq))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    assert counter.get_total_flops() == pytest.approx(batch * seq * forward_flops_per_token(spec, seq), rel=1e-9)


def test_a_run_needing_an_absent_package_is_skipped_with_the_reason():
    assert missing_package({"needs": [("surely_not_installed_pkg.sub", "surely-not")]}) == "surely-not is not installed"
    assert missing_package({"needs": [("json", "json")]}) is None
    assert missing_package({}) is None
