"""Checkpoint completeness on disk (``hl_core/checkpoint_files.py``) and the torn metrics line, in one process."""

import json

from hl_core.checkpoint_files import newest_complete, resume_target, rotate, skipped_notice
from hl_core.sinks import JsonlSink


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
    assert notice.startswith("Ignoring incomplete checkpoint(s) step_14, step_12") and "resuming from `step_10`" in notice
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
