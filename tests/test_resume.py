"""Resume: 6 updates straight == 3 updates, stop, resume, 3 more (fp32 CPU, per-step losses within 1e-6)."""

import pytest

from helpers import TINY_HUMANLINE, read_jsonl, run_recipe

COMMON = [
    "train.max_steps=6", "train.lr_schedule=linear", "train.warmup_steps=1", "eval.every=null",
    "checkpoint.save_every=null", "checkpoint.save_final=false", "humanline.sync_every=2",
]


@pytest.mark.parametrize(
    "stage, nproc, extra",
    [
        # ZeRO-0, one process, humanline *sampling*: the transform's generator state must resume too
        (0, 1, ["humanline.transform=sample"]),
        # ZeRO-3, two processes: optimizer partitions and each rank's reference shard resume
        (3, 2, ["engine.zero3_param_persistence_threshold=100"]),
    ],
)
def test_resume_matches_uninterrupted(tmp_path, stage, nproc, extra):
    overrides = COMMON + [f"engine.zero_stage={stage}"] + extra
    straight = tmp_path / "straight"
    run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={straight}"], nproc=nproc)
    resumed = tmp_path / "resumed"
    first = run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={resumed}", "train.stop_after=3"], nproc=nproc)
    assert "Stopped after update 3" in first.stdout
    assert (resumed / "checkpoints" / "step_3").is_dir()
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl")] == [0, 1, 2]
    second = run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={resumed}"], nproc=nproc)
    assert "Resumed from" in second.stdout

    a = read_jsonl(straight / "metrics.jsonl")
    b = read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(6))
    for row_a, row_b in zip(a, b):
        assert abs(row_a["loss"] - row_b["loss"]) <= 1e-6, (row_a["step"], row_a["loss"], row_b["loss"])
        assert abs(row_a["lr"] - row_b["lr"]) <= 1e-12
    # the later steps really differ from step 0 (so the comparison is not vacuous)
    assert abs(a[5]["loss"] - a[0]["loss"]) > 1e-4


def test_stop_file_checkpoints_and_exits_cleanly(tmp_path):
    """A launcher (the SLURM time-limit trap) creates <output_dir>/STOP: the run checkpoints and exits 0."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP").write_text("")
    common = [f"output_dir={out}", "train.max_steps=2", "eval.every=null", "checkpoint.save_every=null"]
    first = run_recipe(TINY_HUMANLINE, common)
    assert "STOP found" in first.stdout and "Stopped after update 0" in first.stdout
    assert (out / "checkpoints" / "step_0").is_dir() and not (out / "STOP").exists()
    assert not (out / "final").exists()
    second = run_recipe(TINY_HUMANLINE, common)
    assert "Resumed from" in second.stdout and (out / "final").is_dir()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]
