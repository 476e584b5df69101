"""tools/plan_outputs.py, the before/after check of ``--plan``: a recipe's output under a layout is its report with the
exit code and its plan dict; two folders compare equal only byte for byte (the full sweep is exercised by running
the tool; see its docstring)."""

import json

from helpers import REPO
from tools import plan_outputs


def test_one_output_and_the_comparison(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.chdir(REPO)
    before, after = tmp_path / "before", tmp_path / "after"
    for folder in (before, after):
        folder.mkdir()
        plan_outputs.write_one(folder, REPO / "recipes/tiny/humanline_dpo.yaml", "zero3")
    text = (before / "tiny__humanline_dpo@zero3.txt").read_text()
    assert text.startswith("exit 0\n") and "DeepSpeed ZeRO-3" in text
    assert json.loads((before / "tiny__humanline_dpo@zero3.json").read_text())["world_size"] == 8
    assert plan_outputs.compare(before, after) == 0
    (after / "tiny__humanline_dpo@zero3.json").write_text("{}\n")
    (after / "extra@as_written.txt").write_text("")
    assert plan_outputs.compare(before, after) == 2
    out = capsys.readouterr().out
    assert "tiny__humanline_dpo@zero3.json: differs" in out and "extra@as_written.txt: only in" in out


def test_the_studies_start_from_the_toy_task():
    warmup, arm = REPO / "recipes/repro/warmup.yaml", REPO / "recipes/repro/preference/dpo_offline.yaml"
    assert plan_outputs.start_overrides(warmup) == []
    assert plan_outputs.start_overrides(arm) == ["model.name_or_path=tests/fixtures/toy_add/model",
                                                  "data.train.path=tests/fixtures/toy_add/pref_pairs_sample.jsonl"]
