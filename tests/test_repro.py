"""The reproduction study's built-in sanity checks, on the shortened grid (`python -m eval.repro --quick`):
the online importance ratio is exactly 1; humanline with k=1 and fresh samples every update tracks online;
the same seed gives the same curve twice; every result file records versions and threads."""

import json
from pathlib import Path

import pytest

from helpers import pinned_for_these_kernels, run_study

REPO = Path(__file__).resolve().parents[1]
PIN = REPO / "tests" / "fixtures" / "repro_quick_pin.json"


@pytest.fixture(scope="module")
def quick(tmp_path_factory, repro_cache, repro_pool):
    out = tmp_path_factory.mktemp("repro") / "quick"
    proc = run_study(["--quick", "--out", out, "--cache", repro_cache], repro_pool)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_online_ratio_is_exactly_one(quick):
    _, result = quick
    assert result["sanity"]["online_ratio_exactly_one"] is True
    online = [r for r in result["runs"] if r["arm"] == "online"]
    assert len(online) == len(result["warmups"]) * len(result["seeds"]) >= 2


def test_humanline_k1_with_fresh_samples_tracks_online(quick):
    """Update 0 is identical (reference = behaviour = start policy); afterwards the ratio is taken against
    the previous update's weights instead of the behaviour policy, so the curves stay close, not equal."""
    _, result = quick
    sanity = result["sanity"]
    assert sanity["humanline_k1_online_first_update_loss_equal"] is True
    assert sanity["humanline_k1_online_mean_curve_gap"] <= 0.05


def test_warmups_are_a_random_factor(quick):
    """Two warm-up models (train.seed 0 and 1) differ, so their arms start from different held-out accuracy."""
    _, result = quick
    assert result["warmups"] == [0, 1]
    start = {r["warmup"]: r["values"][0] for r in result["runs"] if r["arm"] == "online"}
    assert start[0] != start[1], start


def test_pinned_curve(quick, tmp_path):
    """The quick grid's online run (warm-up 0, seed 0), warm-up included, against values stored from an earlier
    commit: a change that moves results is noticed here, and the stored study is then re-run on purpose.
    Update 0's gradient norm (after the warm-up and the first sampled groups) to 1e-3 relative; held-out accuracy
    within 2 of the 64 problems and each update's mean rollout reward within 2 of 32 samples (room for another
    CPU's rounding to flip a sample). Compared with the pin of the machine whose CPU kernels compute the same bytes
    (`helpers.pinned_for_these_kernels`: skipped, with the way to pin it, where they differ from every pinned one's)."""
    _, result = quick
    run = next(r for r in result["runs"] if r["arm"] == "online" and r["warmup"] == 0 and r["seed"] == 0)
    actual = {"steps": run["steps"], "accuracy": run["values"], "first_grad_norm": run["grad_norms"][0],
              "reward_means": run["reward_means"]}
    pinned, hint = pinned_for_these_kernels(PIN, actual, result["environment"]["kernel_fingerprint"], tmp_path)
    assert actual["steps"] == pinned["steps"], hint
    assert actual["accuracy"] == pytest.approx(pinned["accuracy"], abs=2 / 64 + 1e-9), hint
    assert actual["first_grad_norm"] == pytest.approx(pinned["first_grad_norm"], rel=1e-3), hint
    assert actual["reward_means"] == pytest.approx(pinned["reward_means"], abs=2 / 32 + 1e-9), hint


def test_same_seed_same_curve(quick):
    _, result = quick
    assert result["sanity"]["same_seed_same_curve"] is True
    assert result["sanity"]["same_seed_same_losses"] is True


def test_result_files_record_versions_threads_and_statistics(quick):
    out, result = quick
    env = result["environment"]
    for key in ("torch", "transformers", "deepspeed", "python", "threads_per_process", "cpu_count", "cpu_kernels"):
        assert env[key], key
    from eval.repro.kernels import KINDS  # what the runs' kernels computed: hashes of 16 hex digits per kind

    assert all(len(env["kernel_fingerprint"][k]) == 16 for k in KINDS) and env["kernel_fingerprint"]["cpu"]
    assert all(r["torch_threads"] == 1 and r["deterministic"] is True for r in result["runs"])
    arms = result["summary"]["arms"]
    assert {"online", "sparse", "humanline_sparse_k1", "offline", "offline_humanline",
            "humanline_online_k1"} <= set(arms)
    for entry in arms.values():
        assert entry["auc"]["lo"] <= entry["auc"]["mean"] <= entry["auc"]["hi"]
        assert entry["auc"]["groups"] == len(result["warmups"]) == 2  # warm-up models resampled first
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
    assert "unknown arm(s) or regime(s) onlin" in capsys.readouterr().err
    assert cli(["--sweep", "--regimes", "lr1e-4_T0.8"]) == 2
    assert "lr1e-4_T0.7" in capsys.readouterr().err  # the known regimes are listed


def test_a_failing_run_is_reported_with_its_log_not_a_traceback(tmp_path, capsys, monkeypatch):
    from eval.repro import __main__ as repro

    run = repro.Run("online", 0, repro.RECIPES / "online.yaml", ["train.max_steps=0"], tmp_path / "bad")
    monkeypatch.setattr(repro, "accepted_warmups", lambda *a, **k: ({0: tmp_path / "no-model"}, []))
    monkeypatch.setattr(repro, "grid_runs", lambda *a, **k: [run])
    assert repro.cli(["--arms", "online", "--seeds", "1", "--out", str(tmp_path / "out"), "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "run online warm-up 0 seed 0 failed (exit 2)" in err and "driver.log" in err and "Traceback" not in err


def test_warmups_below_the_minimum_are_replaced_by_the_next_seed(tmp_path, monkeypatch):
    """Seeds are tried in order; one whose held-out accuracy at the end of the warm-up is under the grid's minimum
    is recorded as rejected and the next seed is drawn until enough pass."""
    from eval.repro import __main__ as repro, runs
    from eval.repro.studies import FULL

    accuracy = {0: 0.29, 1: 0.03, 2: 0.27, 3: 0.31}
    asked = []

    def fake_warmups(cache, overrides, seeds, pool, name="warmup"):
        asked.append(list(seeds))
        assert "eval.held_out=reward" in overrides and "eval.every=600" in overrides
        out = {}
        for s in seeds:
            final = tmp_path / f"w{s}" / "final"
            final.mkdir(parents=True)
            (final.parent / "eval.jsonl").write_text(json.dumps({"step": 600, "reward": accuracy[s]}) + "\n")
            out[s] = final
        return out

    monkeypatch.setattr(runs, "warmups", fake_warmups)
    models, table = repro.accepted_warmups(tmp_path, FULL, 3, pool=None)
    assert sorted(models) == [0, 2, 3] and asked == [[0, 1, 2], [3]]
    assert [w["accepted"] for w in table] == [True, False, True, True]
