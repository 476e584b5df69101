"""``eval/report.py``: PNG plots + HTML from two runs' metrics.jsonl (a DPO-like humanline run with held-out
eval and eval/*.json results, and a KTO-like offline run given as a bare metrics file)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from eval._common import EvalError
from eval.report import PLOTS, load_run, main, render_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _dpo_run(root: Path) -> Path:
    run = root / "humanline_dpo"
    rows = []
    for s in range(30):
        rows.append({"step": s, "loss": 0.69 * math.exp(-s / 20), "lr": 1e-3, "grad_norm": 0.5,
                     "rewards/chosen": 0.01 * s, "rewards/rejected": -0.01 * s, "rewards/margin": 0.02 * s,
                     "rewards/accuracy": 0.5 + s / 60, "unclamped_frac": 1.0 - s / 100, "synced": True,
                     "step_time_s": 0.05 + 0.001 * (s % 3), "sync_time_s": 0.002, "tokens_per_s": 9000.0})
    _write_jsonl(run / "metrics.jsonl", rows)
    _write_jsonl(run / "eval.jsonl", [{"step": s, "loss": 0.69 - 0.005 * s, "rewards/margin": 0.015 * s}
                                      for s in (0, 10, 20, 30)])
    (run / "summary.json").write_text(json.dumps({"updates": 30}))
    (run / "eval").mkdir()
    (run / "eval" / "math500.json").write_text(json.dumps({"task": "math500", "pass@1": 0.593, "pass@1_std": 0.019,
                                                           "n_samples": 4}))
    (run / "eval" / "alpaca_eval.json").write_text(json.dumps({"win_rate": 41.2, "length_controlled_winrate": None}))
    return run


def _kto_metrics(root: Path) -> Path:
    rows = [{"step": s, "loss": 0.5 - 0.004 * s, "rewards/desirable": 0.02 * s, "rewards/undesirable": -0.01 * s,
             "kto/z0": 0.0, "unclamped_frac": 1.0, "step_time_s": 0.03, "sync_time_s": 0.0, "tokens_per_s": 12000.0}
            for s in range(25)]
    return _write_jsonl(root / "offline_kto" / "metrics.jsonl", rows)


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_report_renders_pngs_and_html(tmp_path):
    import matplotlib.image as mpimg

    dpo = _dpo_run(tmp_path)
    kto = _kto_metrics(tmp_path)
    out = tmp_path / "report"
    res = render_report([f"humanline={dpo}", str(kto)], str(out), smooth_alpha=0.5)
    assert set(res["pngs"]) == set(PLOTS)
    for name in PLOTS:
        png = out / f"{name}.png"
        assert _is_png(png), name
        img = mpimg.imread(png)  # decodes: a valid image, not just a header
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100
    html = (out / "index.html").read_text()
    assert res["runs"] == ["humanline", "offline_kto"]
    for needle in ("humanline", "offline_kto", "loss.png", "step_time.png", "0.593 ± 0.019", "WR 41.2"):
        assert needle in html


def test_report_cli_and_placeholders(tmp_path, capsys):
    # a run that logged only the loss: every plot is still written (saying what is missing)
    only_loss = _write_jsonl(tmp_path / "bare" / "metrics.jsonl",
                             [{"step": s, "loss": 1.0 / (s + 1)} for s in range(5)])
    kto = _kto_metrics(tmp_path)
    out = tmp_path / "r2"
    assert main([str(only_loss), str(kto), "--output", str(out), "--title", "cmp"]) == 0
    assert all(_is_png(out / f"{name}.png") for name in PLOTS)
    assert "<title>cmp</title>" in (out / "index.html").read_text()
    assert "wrote" in capsys.readouterr().out


def test_report_errors(tmp_path):
    with pytest.raises(EvalError, match="no metrics file"):
        load_run(str(tmp_path / "missing"))
    bad = tmp_path / "bad" / "metrics.jsonl"
    bad.parent.mkdir()
    bad.write_text("{not json\n")
    with pytest.raises(EvalError, match="not valid JSON"):
        load_run(str(bad))
