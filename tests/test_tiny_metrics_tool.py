"""tools/tiny_metrics.py, the before/after check of a restructure: two runs' ``metrics.jsonl`` compare equal when only
the timing fields differ, and not when a computed value, a row or a recipe does (the runs themselves are exercised by
running the tool; see its docstring)."""

import importlib.util
import json

from helpers import REPO

spec = importlib.util.spec_from_file_location("tiny_metrics", REPO / "tools" / "tiny_metrics.py")
tiny_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tiny_metrics)


def _write(root, name, rows):
    (root / name).mkdir(parents=True)
    (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_equal_but_for_timing_and_different_otherwise(tmp_path, capsys):
    row = {"step": 0, "loss": 0.69, "lr": 1e-3, "step_time_s": 0.2, "sync_time_s": 0.01, "tokens_per_s": 900.0}
    _write(tmp_path / "a", "dpo", [row, dict(row, step=1)])
    _write(tmp_path / "b", "dpo", [dict(row, step_time_s=9.0, tokens_per_s=1.0), dict(row, step=1, sync_time_s=3.0)])
    assert tiny_metrics.compare(tmp_path / "a", tmp_path / "b") == 0
    _write(tmp_path / "c", "dpo", [row, dict(row, step=1, loss=0.6900001)])
    assert tiny_metrics.compare(tmp_path / "a", tmp_path / "c") == 1
    _write(tmp_path / "d", "dpo", [row])
    assert tiny_metrics.compare(tmp_path / "a", tmp_path / "d") == 1
    assert tiny_metrics.compare(tmp_path / "a", tmp_path / "missing") == 1
    out = capsys.readouterr().out
    assert "row 1 key 'loss'" in out and "2 rows vs 1" in out and "missing" in out
