"""``--rehearse`` on a CPU (issue 39): progress lines while a rank runs, and a fast default (at most 4
micro-batches per update, at least the pipeline's stages; time and traffic per update scaled back, said in the
output), with the recipe's full count one flag away (``--rehearse-micro-batches all``)."""

from __future__ import annotations

import pytest

from helpers import TINY_HUMANLINE, rehearse
from hl_core.rehearsal.inputs import DEFAULT_CPU_MICRO_BATCHES, micro_batch_cap
from hl_core.rehearsal.run import micro_batch_words, progress_line


@pytest.mark.parametrize("requested, on_cpu, pp, cap", [
    (None, True, 1, DEFAULT_CPU_MICRO_BATCHES), (None, True, 8, 8), (None, False, 1, None), ("all", True, 1, None),
    (16, True, 1, 16), (2, False, 4, 2),
])
def test_micro_batch_cap(requested, on_cpu, pp, cap):
    assert micro_batch_cap(requested, on_cpu, pp) == cap


def test_progress_words():
    assert micro_batch_words(1, 4, 3) == "update 1 of 3 (warm-up), micro-batch 1 of 4"
    assert micro_batch_words(8, 4, 3) == "update 2 of 3 (measured), micro-batch 4 of 4"
    assert micro_batch_words(9, 4, 3) == "update 3 of 3 (timed), micro-batch 1 of 4"
    assert progress_line(1, 4, "x", 12.4) == "rehearsal rank 1 of 4: x (12s)"


def test_cpu_default_runs_four_micro_batches_scaled_and_says_so(tmp_path):
    """Rank 1 of 4 (ZeRO-2) with 8 micro-batches per update: 4 run, the report says so and how to run all 8, and
    the progress lines name each update's last micro-batch; ``all`` runs the 8."""
    overrides = ("engine.zero_stage=2", "cluster.gpus_per_node=4", "train.global_batch_size=256")
    for name in ("default", "all"):
        (tmp_path / name).mkdir()
    result, stdout = rehearse(tmp_path / "default", TINY_HUMANLINE, 1, *overrides)
    assert (result["micro_batches"], result["accumulation"]) == (4, 8), result
    assert "gradient accumulation 8 -> 4 micro-batches per update" in stdout
    assert "`--rehearse-micro-batches all` runs all 8" in stdout
    assert "rehearsal rank 1 of 4: building the engine" in stdout
    for line in ("update 1 of 3 (warm-up), micro-batch 4 of 4", "update 2 of 3 (measured), micro-batch 4 of 4"):
        assert f"rehearsal rank 1 of 4: {line}" in stdout, stdout[-3000:]
    full, stdout = rehearse(tmp_path / "all", TINY_HUMANLINE, 1, *overrides, "--rehearse-micro-batches", "all")
    assert (full["micro_batches"], full["accumulation"]) == (8, 8) and "micro-batch 8 of 8" in stdout
