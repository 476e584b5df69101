"""Shared by tests/test_trl_*.py: the pack's per-update losses on a tiny recipe and a humanline TRL trainer's, on
the same saved weights and the same token ids in the same order (fp32, CPU, k = 2, bounds that bind)."""

import json

from helpers import REPO, read_jsonl, run_recipe, run_torchrun

RUN = REPO / "tests" / "distributed" / "trl_run.py"
STEPS, K = 8, 2
CLIP = (-0.05, 0.05)  # binds on well over 5% of the tokens once the policy moves


def pack_losses(recipe, weights, tmp_path, *overrides, nproc=1):
    """``launchers/run.py RECIPE`` from ``weights``, rows in file order, a constant learning rate (TRL's warm-up
    starts at 0, ours at 1/warmup: both without one), the reference a copy synced every K updates."""
    out = tmp_path / f"pack_{recipe.stem}_{nproc}"
    run_recipe(recipe, [f"output_dir={out}", f"model.name_or_path={weights}", "model.random_init=false",
                        "data.shuffle=false", f"train.max_steps={STEPS}", f"humanline.sync_every={K}",
                        f"humanline.log_eps_P={CLIP[0]}", f"humanline.log_eps_R={CLIP[1]}", "train.warmup_steps=0",
                        "humanline.reference=copy", "eval.every=null", "checkpoint.save_every=null",
                        "checkpoint.save_final=false", *overrides], nproc=nproc)
    return [row["loss"] for row in read_jsonl(out / "metrics.jsonl")]


def trl_run(kind, weights, tmp_path, *args, nproc=1, name="trl", k=K):
    """The humanline TRL trainer's report per rank: ``history`` (one row per update), ``calls`` (each sync call and
    the collectives during it), ``hooks`` (weight checksums where a sync could run) and ``restores`` (the sync
    state loaded on resume); the reference synced every ``k`` updates."""
    report = tmp_path / f"{name}_{kind}"
    run_torchrun(RUN, [report, "--trainer", kind, "--model", weights, "--steps", STEPS, "--sync-every", k,
                       "--clip", *CLIP, "--out", tmp_path / f"{name}_out", *args], nproc=nproc)
    return [json.loads((tmp_path / f"{report.name}.rank{r}.json").read_text()) for r in range(nproc)]


def max_diff(history, pack):
    assert len(history) == len(pack) == STEPS, (history, pack)
    return max(abs(row["loss"] - p) for row, p in zip(history, pack))


def check_equal(reports, pack, kind):
    """Equal within 1e-5, with the clip binding on >= 5% of tokens at some update and the sync on schedule."""
    history = reports[0]["history"]
    clipped = max(row["clipped_frac"] for row in history)
    print(f"{kind}: max clipped fraction {clipped:.3f}, max |loss - pack| {max_diff(history, pack):.2e}")
    assert clipped >= 0.05, history
    assert [row["synced"] for row in history] == [n % K == 0 for n in range(STEPS)], history
    assert max_diff(history, pack) <= 1e-5, (history, pack)
    for report in reports:
        assert [c["synced"] for c in report["calls"]] == [n % K == 0 for n in range(STEPS)]
        assert all(c["sync_collectives"] == 0 for c in report["calls"]), report["calls"]
