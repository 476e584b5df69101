"""The pack's trainer resumes humanline sampling exactly on two processes at ZeRO-2, where DeepSpeed keeps one client
state (rank 0's): each rank's sampling generators are in its own ``transform_rank<r>.pt``, so the resumed run gives
the uninterrupted losses with a gap of 0.0 (fp32, CPU). Without rank 1's file (its generator restarts from its seed,
as when only rank 0's state was kept) the losses differ: the comparison is not vacuous."""

import shutil

from helpers import TINY_HUMANLINE, read_jsonl, run_recipe

COMMON = ["humanline.transform=sample", "engine.zero_stage=2", "train.max_steps=6", "eval.every=null",
          "checkpoint.save_every=3", "checkpoint.save_final=false", "humanline.sync_every=2"]


def _losses(out):
    return [row["loss"] for row in read_jsonl(out / "metrics.jsonl")]


def test_sampling_resumes_exactly_on_two_ranks_and_not_without_each_ranks_draws(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_recipe(TINY_HUMANLINE, COMMON + [f"output_dir={straight}"], nproc=2)
    run_recipe(TINY_HUMANLINE, COMMON + [f"output_dir={stopped}", "train.stop_after=3"], nproc=2)
    checkpoint = stopped / "checkpoints" / "step_3"
    assert sorted(p.name for p in checkpoint.glob("transform_rank*.pt")) == ["transform_rank00000.pt",
                                                                            "transform_rank00001.pt"]
    forgetful = tmp_path / "forgetful"
    shutil.copytree(stopped, forgetful)
    (forgetful / "checkpoints" / "step_3" / "transform_rank00001.pt").unlink()

    run_recipe(TINY_HUMANLINE, COMMON + [f"output_dir={stopped}"], nproc=2)
    whole, resumed = _losses(straight), _losses(stopped)
    assert len(whole) == len(resumed) == 6
    gap = max(abs(a - b) for a, b in zip(whole, resumed))
    print(f"sampling, 2 ranks, ZeRO-2: max |loss - uninterrupted| {gap:.2e}")
    assert gap == 0.0, (whole, resumed)

    run_recipe(TINY_HUMANLINE, COMMON + [f"output_dir={forgetful}"], nproc=2)
    gap = max(abs(a - b) for a, b in zip(whole, _losses(forgetful)))
    print(f"without rank 1's draws: max |loss - uninterrupted| {gap:.2e}")
    assert gap > 1e-7
