"""A ``STOP`` file older than the run (issue 39): named in one line as stale, and honoured (the run checkpoints at
its first update boundary and exits 0, resumable), as the README's Reliability section says."""

import os
import time

from helpers import TINY_HUMANLINE, run_recipe
from hl_core.loop.lifecycle import process_started_at, stale_stop_notice


def test_stale_stop_notice_names_the_file_only_when_it_predates_the_run(tmp_path):
    stop = tmp_path / "STOP"
    assert stale_stop_notice(None, 100.0, True, stop) == ""  # no STOP file
    assert stale_stop_notice(100.5, 100.0, False, stop) == ""  # written during this run: a request to this run
    for mtime, taken_over in ((50.0, False), (100.5, True)):
        line = stale_stop_notice(mtime, 100.0, taken_over, stop)
        assert f"`{stop}` is stale" in line and "honoured" in line and "delete" in line, line
    assert "gone" in stale_stop_notice(100.5, 100.0, True, stop)
    started = process_started_at()
    assert started is not None and started <= time.time() and process_started_at(os.getppid()) <= started


def test_a_stop_left_before_the_run_is_named_stale_and_honoured(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP").write_text("")
    os.utime(out / "STOP", (time.time() - 60, time.time() - 60))  # an earlier, killed run's
    common = [f"output_dir={out}", "train.max_steps=2", "eval.every=null", "checkpoint.save_every=null"]
    first = run_recipe(TINY_HUMANLINE, common)
    assert f"`{out / 'STOP'}` is stale (written at" in first.stdout, first.stdout[-2000:]
    assert "Stopped after update 0" in first.stdout and not (out / "STOP").exists()
    second = run_recipe(TINY_HUMANLINE, common)
    assert "is stale" not in second.stdout and (out / "final").is_dir()
