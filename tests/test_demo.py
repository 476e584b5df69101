"""The README demo end to end: one process, the tiny humanline DPO recipe, all outputs checked."""

import json
import math

import pytest
import torch

from helpers import TINY_HUMANLINE, TINY_OFFLINE, read_jsonl, run_recipe

REQUIRED = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "sync_time_s", "unclamped_frac",
            "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "synced"}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    proc = run_recipe(TINY_HUMANLINE, [f"output_dir={out}"])
    return out, proc


def test_demo_metrics_and_learning(demo):
    out, proc = demo
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(40))
    for row in rows:
        assert REQUIRED <= set(row), REQUIRED - set(row)
        assert row["synced"] is True  # k = 1
        assert 0.0 <= row["unclamped_frac"] <= 1.0
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-6  # policy == reference at step 0
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 10, 20, 30, 40]
    assert evals[0]["rewards/accuracy"] == 0.5  # all ties at the start: policy == reference
    # reference-free held-out accuracy (the humanline reference moves): the demo visibly learns
    assert evals[0]["policy/accuracy"] < 0.7 and evals[-1]["policy/accuracy"] > 0.9
    assert "preference accuracy (policy log-prob of chosen > rejected)" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates"] == 40 and summary["eval_end/policy/accuracy"] == evals[-1]["policy/accuracy"]


def test_demo_checkpoints_rotate_and_final_loads(demo):
    out, _ = demo
    ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert ckpts == ["step_20", "step_40"]  # save_every 20, keep_last 2
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_40"
    # offline syncing runs without a reference copy: the checkpoint keeps the look-ahead log-probs instead
    assert (out / "checkpoints" / "step_40" / "reference_logps_rank00000.pt").exists()
    assert not (out / "checkpoints" / "step_40" / "reference_rank00000.pt").exists()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    assert any((out / "final").glob("*.safetensors"))
    ids = tokenizer("a short test", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_plain_dpo_step0_is_ln2_and_never_syncs(tmp_path):
    run_recipe(TINY_OFFLINE, [f"output_dir={tmp_path}", "train.max_steps=3", "eval.every=null",
                              "checkpoint.save_every=null", "checkpoint.save_final=false"])
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert abs(rows[0]["loss"] - math.log(2)) < 1e-6
    assert [r["synced"] for r in rows] == [False, False, False]
    assert all(r["sync_time_s"] == 0.0 for r in rows)


def test_post_training_eval_block_runs_after_training(tmp_path):
    """`eval.data_quality.enabled: true` in a recipe: evaluated on rank 0 after training, JSON in output_dir/eval."""
    proc = run_recipe(TINY_HUMANLINE, [f"output_dir={tmp_path}", "train.max_steps=2", "eval.every=null",
                                       "checkpoint.save_every=null", "eval.data_quality.enabled=true",
                                       "eval.data_quality.limit=8"])
    report = json.loads((tmp_path / "eval" / "data_quality.json").read_text())
    assert "post-training evals: data_quality" in proc.stdout
    assert report["mean_logp"] < 0 and len(report["quartiles"]) >= 3
    records = (tmp_path / "eval" / "data_quality_records.jsonl").read_text().splitlines()
    assert len(records) == 8
