"""The TRL examples run as documented (``python examples/<name>.py``, one CPU process) and print one row per update
with the loss, the clipped fraction and whether the reference synced (k = 2)."""

import re

import pytest

from helpers import REPO, run_fresh

pytest.importorskip("trl")
LINE = re.compile(r"^update (\d+)  loss (\S+)  clipped (\S+)  synced (True|False)$", re.M)


@pytest.mark.parametrize("example", ["trl_dpo.py", "trl_grpo.py"])
def test_example_prints_per_update_losses_and_the_clipped_fraction(example, tmp_path):
    proc = run_fresh([REPO / "examples" / example, "--steps", "4", "--output-dir", tmp_path])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = LINE.findall(proc.stdout)
    assert [int(n) for n, *_ in rows] == [0, 1, 2, 3], proc.stdout[-2000:]
    assert [synced == "True" for *_, synced in rows] == [True, False, True, False]
    assert max(float(clipped) for _, _, clipped, _ in rows) > 0.05  # the default bounds bind
