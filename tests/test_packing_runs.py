"""`data.packing: true` against padded micro-batches through the real trainer and DeepSpeed engine: the same
per-update losses, gradient norms and every other metric within 1e-5 (fp32, CPU) for DPO, KTO, GRPO on offline
groups and on rollouts, and SFT, with humanline clipping and syncing on; one process and two ZeRO-3 processes.
The megatron engine refuses packing with the reason."""

from __future__ import annotations

import math

import pytest

from helpers import REPO, read_jsonl, run_recipe
from launchers.run import main

TINY = REPO / "recipes" / "tiny"
SHORT = ["train.max_steps=3", "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false"]
TIMING = ("step_time_s", "sync_time_s", "rollout_time_s", "train_time_s", "tokens_per_s")


def _metrics(recipe, overrides, out, nproc=1):
    run_recipe(recipe, [*SHORT, *overrides, f"output_dir={out}"], nproc=nproc)
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read_jsonl(out / "metrics.jsonl")]


def _assert_same(padded, packed):
    assert len(padded) == len(packed) == 3
    for a, b in zip(padded, packed):
        assert a.keys() == b.keys()
        for key, value in a.items():
            if isinstance(value, float) and not math.isnan(value):
                assert b[key] == pytest.approx(value, abs=1e-5, rel=1e-5), (a["step"], key)
            else:
                assert b[key] == value, (a["step"], key)


@pytest.mark.parametrize("recipe, overrides", [
    (TINY / "humanline_dpo.yaml", []),
    (TINY / "humanline_kto.yaml", []),
    (TINY / "humanline_grpo.yaml", []),
    (TINY / "humanline_sparse_grpo_math.yaml", ["rollout.every=1"]),
    (REPO / "recipes" / "repro" / "warmup.yaml", ["train.micro_batch_size=16"]),
], ids=["dpo", "kto", "grpo_groups", "grpo_rollouts", "sft"])
def test_packed_equals_padded(recipe, overrides, tmp_path):
    padded = _metrics(recipe, overrides, tmp_path / "padded")
    packed = _metrics(recipe, [*overrides, "data.packing=true"], tmp_path / "packed")
    _assert_same(padded, packed)


def test_packed_equals_padded_zero3_two_processes(tmp_path):
    overrides = ["engine.zero_stage=3"]
    padded = _metrics(TINY / "humanline_dpo.yaml", overrides, tmp_path / "padded", nproc=2)
    packed = _metrics(TINY / "humanline_dpo.yaml", [*overrides, "data.packing=true"], tmp_path / "packed", nproc=2)
    _assert_same(padded, packed)


def test_megatron_refuses_packing(capsys):
    assert main([str(TINY / "megatron_humanline_dpo.yaml"), "--validate", "data.packing=true"]) == 2
    assert "Transformer Engine" in capsys.readouterr().err
