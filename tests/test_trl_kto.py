"""Humanline KTO on TRL's KTOTrainer (``hl_core.integrations.trl``) gives the pack's per-update losses
(``launchers/run.py recipes/tiny/humanline_kto.yaml``) within 1e-5 on one CPU process: the same examples (each pair's
chosen then rejected completion), the same mismatched KL completions, z0 from the clipped KL rows."""

import pytest

from helpers import REPO
from trl_common import check_equal, pack_losses, trl_run

pytest.importorskip("trl")


def test_kto_equals_the_pack(weights, tmp_path):
    pack = pack_losses(REPO / "recipes" / "tiny" / "humanline_kto.yaml", weights, tmp_path)
    check_equal(trl_run("kto", weights, tmp_path), pack, "kto, one process")
