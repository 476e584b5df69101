"""Humanline GRPO on TRL's GRPOTrainer (``hl_core.integrations.trl``) gives the pack's per-update losses
(``launchers/run.py recipes/tiny/humanline_grpo.yaml``: offline groups, PPO clip 0.2, token aggregation, no KL term)
within 1e-5 on one CPU process: the same completions fed as offline groups (TRL ``loss_type='bnpo'``,
``temperature=1.0``, ``beta=0``), the ratio exp() of the clipped log-ratio against the synced reference."""

import pytest

from helpers import REPO
from trl_common import check_equal, pack_losses, trl_run

pytest.importorskip("trl")


def test_grpo_on_offline_groups_equals_the_pack(weights, tmp_path):
    pack = pack_losses(REPO / "recipes" / "tiny" / "humanline_grpo.yaml", weights, tmp_path)
    check_equal(trl_run("grpo", weights, tmp_path), pack, "grpo, one process")
