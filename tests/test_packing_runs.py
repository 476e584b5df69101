"""`data.packing: true` against padded micro-batches through the real trainer and DeepSpeed engine: the same
per-update losses, gradient norms and every other metric within 1e-5 (fp32, CPU) for DPO, KTO, GRPO on offline
groups and on rollouts, and SFT, with humanline clipping and syncing on; one process and two ZeRO-3 processes
(`tests/distributed/mode_parity.py` runs both modes from the same start in one process per rank). The
megatron engine refuses packing with the reason."""

from __future__ import annotations

import json

from helpers import REPO, assert_same_rows, run_worker
from launchers.run import main

WORKER = REPO / "tests" / "distributed" / "mode_parity.py"
SINGLE = [
    "recipes/tiny/humanline_dpo.yaml",
    "recipes/tiny/humanline_kto.yaml",
    "recipes/tiny/humanline_grpo.yaml",
    "recipes/tiny/humanline_sparse_grpo_math.yaml|rollout.every=1",
    "recipes/repro/warmup.yaml|train.micro_batch_size=16,data.max_length=24",  # bins of 24: two rows each
]


def _run(specs, tmp_path, nproc=1):
    out = tmp_path / "parity.json"
    run_worker(WORKER, [out, *specs], nproc=nproc)
    return json.loads(out.read_text())


def _assert_same(modes, name):
    """Equal metrics, and the packed run really packed (every forward, fewer rows than the padded batch at least
    once) while the padded one never did."""
    padded, packed = modes["padded"], modes["packed"]
    assert modes["padded_forwards"] == [] and modes["packed_forwards"], name
    assert any(bins < rows for rows, bins in modes["packed_forwards"]), name
    assert len(padded) == len(packed) == 3
    assert_same_rows(padded, packed, name, tol=1e-5)


def test_packed_equals_padded_one_process(tmp_path):
    results = _run(SINGLE, tmp_path)
    assert len(results) == len(SINGLE)
    for name, modes in results.items():
        _assert_same(modes, name)
    # the runs train: humanline DPO's loss moves over its three updates
    dpo = results["humanline_dpo"]["padded"]
    assert dpo[0]["loss"] != dpo[-1]["loss"]


def test_packed_equals_padded_zero3_two_processes(tmp_path):
    results = _run(["recipes/tiny/humanline_dpo.yaml|engine.zero_stage=3"], tmp_path, nproc=2)
    modes = next(iter(results.values()))
    _assert_same(modes, "zero3")


def test_megatron_refuses_packing(capsys):
    assert main([str(REPO / "recipes" / "tiny" / "megatron_humanline_dpo.yaml"), "--validate",
                 "data.packing=true"]) == 2
    assert "Transformer Engine" in capsys.readouterr().err
