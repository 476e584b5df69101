"""Humanline DPO on TRL's DPOTrainer (``hl_core.integrations.trl``) gives the pack's per-update losses
(``launchers/run.py recipes/tiny/humanline_dpo.yaml``) within 1e-5: one CPU process, and DeepSpeed ZeRO-3 on two
processes through accelerate with no collective during a sync. The same trainer with the sync moved to TRL's
``on_step_end`` does not match. And where the hooks fire: under accelerate + DeepSpeed, ``on_pre_optimizer_step``
sees the post-update weights and a torch step pre-hook fires once per ZeRO sub-group, so the adapter syncs in the
engine's step."""

import pytest

from helpers import REPO, TINY_HUMANLINE
from trl_common import check_equal, max_diff, pack_losses, trl_run

pytest.importorskip("trl")


def test_dpo_equals_the_pack_and_only_with_the_sync_before_the_step(weights, tmp_path):
    pack = pack_losses(TINY_HUMANLINE, weights, tmp_path)
    reports = trl_run("dpo", weights, tmp_path)
    check_equal(reports, pack, "dpo, one process")
    for row in reports[0]["hooks"]:  # no DeepSpeed: on_pre_optimizer_step is before the step, as is the sync
        assert row["adapter_sync"] == row["on_pre_optimizer_step"] == row["torch_step_pre_hook"] == [row["begin"]]
        assert row["end"] != [row["begin"]]
    late = trl_run("dpo", weights, tmp_path, "--late", name="late")[0]["history"]
    assert max_diff(late, pack) > 1e-4, "a sync after the optimizer step must not match"


def test_dpo_under_zero3_through_accelerate_equals_the_pack_without_collectives(weights, tmp_path):
    pack = pack_losses(TINY_HUMANLINE, weights, tmp_path, "engine.zero_stage=3",
                       "engine.zero3_param_persistence_threshold=1000", nproc=2)
    reports = trl_run("dpo", weights, tmp_path, "--zero", "3", "--persist-below", "1000", nproc=2)
    check_equal(reports, pack, "dpo, ZeRO-3, 2 processes")
    assert reports[0]["calls"][0]["probe"] > 0  # the counter sees a collective when one runs
    for report in reports:
        for row in report["hooks"]:
            assert row["adapter_sync"] == [row["begin"]]  # the engine's step, wrapped: the pre-update weights
            assert row["on_pre_optimizer_step"] == row["end"] != [row["begin"]]  # after the engine stepped
            hooks = row["torch_step_pre_hook"]  # once per parameter sub-group, the later ones on updated weights
            assert len(hooks) > 1 and hooks[0] == row["begin"] and hooks[-1] != row["begin"]


def test_dpo_with_humanline_sampling_equals_the_pack(weights, tmp_path):
    """``SampleTransform`` (seed 0, as the pack's rank 0) draws for the same positions: the adapter hands it TRL's
    log-probs in the layout of ``input_ids``, so the rejected tokens, and so the losses, are the pack's."""
    pack = pack_losses(REPO / "recipes" / "tiny" / "humanline_sample_dpo.yaml", weights, tmp_path)
    check_equal(trl_run("dpo", weights, tmp_path, "--sample"), pack, "dpo, humanline sampling, one process")
