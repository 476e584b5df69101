"""Checkpoint completeness on disk and safe loading (``hl_core/storage/checkpoints.py``), and the torn metrics line,
in one process."""

import json

import pytest

from helpers import RunsACommand
from hl_core.errors import RecipeError
from hl_core.loop.sinks import JsonlSink
from hl_core.storage.checkpoints import newest_complete, resume_target, rotate, safe_load, skipped_notice


def _step(root, n, complete=True):
    path = root / f"step_{n}"
    path.mkdir(parents=True)
    (path / "mp_rank_00_model_states.pt").write_text("")
    if complete:
        (path / "complete.json").write_text("{}")
    return path


def test_auto_takes_the_newest_complete_checkpoint_and_never_reads_latest(tmp_path):
    ckpts = tmp_path / "checkpoints"
    _step(ckpts, 2), _step(ckpts, 10), _step(ckpts, 12, complete=False), _step(ckpts, 14, complete=False)
    (ckpts / "latest").write_text("step_14")  # DeepSpeed's view after a kill between its files and ours
    chosen, notice = resume_target("auto", tmp_path)
    assert chosen == ckpts / "step_10"
    assert notice.startswith("Ignoring incomplete checkpoint(s) step_14, step_12")
    assert "resuming from `step_10`" in notice
    assert "\n" not in notice
    assert resume_target("never", tmp_path) == (None, "")
    assert resume_target(str(ckpts / "step_2"), tmp_path) == (ckpts / "step_2", "")
    assert resume_target(str(ckpts), tmp_path)[0] == ckpts / "step_10"


def test_nothing_complete_means_a_fresh_start_with_a_notice(tmp_path):
    _step(tmp_path / "checkpoints", 3, complete=False)
    chosen, notice = resume_target("auto", tmp_path)
    assert chosen is None and "starting afresh" in notice
    assert newest_complete(tmp_path / "missing") == (None, []) and skipped_notice([], None) == ""


def test_rotation_keeps_the_newest_complete_and_drops_older_leftovers(tmp_path):
    for n, complete in ((1, True), (2, False), (3, True), (4, True), (5, False)):
        _step(tmp_path, n, complete)
    rotate(tmp_path, keep_last=2)
    # step_5: incomplete but newer than every complete one (a save in progress elsewhere is never removed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4", "step_5"]


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in range(4)) + '{"step": 4, "lo')
    sink = JsonlSink(path, keep_up_to=2)
    sink.write({"step": 3, "loss": 0.25})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


def test_safe_load_refuses_code_and_damage_in_one_paragraph(tmp_path):
    import torch

    marker = tmp_path / "EXECUTED"
    for legacy in (False, True):  # DeepSpeed writes the legacy (non-zip) format
        path = tmp_path / f"evil{legacy}.pt"
        torch.save({"x": RunsACommand(marker)}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(RecipeError, match="Refused to load checkpoint file .* Nothing from it was run"):
            safe_load(path)
        good = tmp_path / f"good{legacy}.pt"
        torch.save({"w": torch.ones(64)}, good, _use_new_zipfile_serialization=not legacy)
        data = good.read_bytes()
        for cut in (0, len(data) // 2):
            (tmp_path / "cut.pt").write_bytes(data[:cut])
            with pytest.raises(RecipeError, match="damaged or truncated"):
                safe_load(tmp_path / "cut.pt")
    assert not marker.exists()
