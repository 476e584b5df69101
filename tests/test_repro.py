"""The reproduction study's built-in sanity checks, on the shortened grid (`python -m eval.repro --quick`):
the online importance ratio is exactly 1; humanline with k=1 and fresh samples every update tracks online;
the same seed gives the same curve twice; every result file records versions and threads."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("repro") / "quick"
    proc = subprocess.run([sys.executable, "-m", "eval.repro", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_online_ratio_is_exactly_one(quick):
    _, result = quick
    assert result["sanity"]["online_ratio_exactly_one"] is True
    online = [r for r in result["runs"] if r["arm"] == "online"]
    assert len(online) == len(result["seeds"]) >= 2


def test_humanline_k1_with_fresh_samples_tracks_online(quick):
    """Update 0 is identical (reference = behaviour = start policy); afterwards the ratio is taken against
    the previous update's weights instead of the behaviour policy, so the curves stay close, not equal."""
    _, result = quick
    sanity = result["sanity"]
    assert sanity["humanline_k1_online_first_update_loss_equal"] is True
    assert sanity["humanline_k1_online_mean_curve_gap"] <= 0.05


def test_same_seed_same_curve(quick):
    _, result = quick
    assert result["sanity"]["same_seed_same_curve"] is True
    assert result["sanity"]["same_seed_same_losses"] is True


def test_result_files_record_versions_threads_and_statistics(quick):
    out, result = quick
    env = result["environment"]
    for key in ("torch", "transformers", "deepspeed", "python", "threads_per_process", "cpu_count"):
        assert env[key], key
    assert all(r["torch_threads"] == 1 and r["deterministic"] is True for r in result["runs"])
    arms = result["summary"]["arms"]
    assert {"online", "sparse", "humanline_sparse_k1", "offline", "offline_humanline", "humanline_online_k1"} <= set(arms)
    for entry in arms.values():
        assert entry["auc"]["lo"] <= entry["auc"]["mean"] <= entry["auc"]["hi"]
        assert entry["wall_clock_s"]["mean"] > 0
    # offline arms generate once (at update 0), sparse ones every `every` updates, online every update
    gen = {a: arms[a]["generation_s"]["mean"] for a in ("online", "offline")}
    assert gen["offline"] > 0
    markdown = (out / "results.md").read_text()
    assert "bootstrap 95%" in markdown and "online GRPO" in markdown
    assert (out / "curves.png").stat().st_size > 1000


def test_unknown_arm_is_a_usage_error(capsys):
    from eval.repro.__main__ import cli

    assert cli(["--arms", "onlin"]) == 2
    assert "unknown arm(s) onlin" in capsys.readouterr().err


def test_a_failing_run_is_reported_with_its_log_not_a_traceback(tmp_path, capsys, monkeypatch):
    from eval.repro import __main__ as repro

    run = repro.Run("online", 0, repro.RECIPES / "online.yaml", ["train.max_steps=0"], tmp_path / "bad")
    monkeypatch.setattr(repro, "warmup", lambda *a, **k: tmp_path / "no-model")
    monkeypatch.setattr(repro, "grid_runs", lambda *a, **k: [run])
    assert repro.cli(["--arms", "online", "--seeds", "1", "--out", str(tmp_path / "out"), "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "run online seed 0 failed (exit 2)" in err and "driver.log" in err and "Traceback" not in err
