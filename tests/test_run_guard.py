"""Runs that must not hand back a broken model, nor run a checkpoint's code (real processes, real engines):

* the issue's diverging recipe stops with exit code 3 at its first non-finite update, keeping the last good
  checkpoint (loadable, finite) and writing no ``final/``; resumed with ``train.on_nonfinite=skip`` it finishes,
  every later update logged as skipped, and ``final/`` equals that checkpoint's finite weights; a checkpoint
  whose weights hold a NaN is never exported to ``final/`` (exit code 3);
* a checkpoint file whose pickle would run ``os.system`` is refused (exit code 2, one paragraph) and runs nothing.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_HUMANLINE, RunsACommand, read_jsonl, run_recipe
from hl_core.loop.guard import GuardFlags, SkipCounter, first_nonfinite, nonfinite_message

DIVERGING = ["train.lr=1e8", "train.max_grad_norm=null", "objective.beta=1000", "train.max_steps=6",
             "checkpoint.save_every=1", "checkpoint.keep_last=1", "eval.every=null"]


def _model_states(step_dir):
    from hl_core.engines.deepspeed_engine import deepspeed_safe_globals

    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        return torch.load(step_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("updates, skipped, warned", [(4, 0, False), (4, 1, False), (4, 2, True), (4, 3, True),
                                                     (0, 0, False)])
def test_summary_counts_skipped_updates_and_warns_past_a_quarter(updates, skipped, warned):
    from hl_core.loop.report import skipped_warning, skipped_words

    words = skipped_words(updates, skipped)
    assert (f"{skipped} skipped as non-finite" in words) == bool(skipped) and words.startswith(f"{updates} updates")
    warning = skipped_warning(updates, skipped)
    assert (warning is not None) == warned
    if warned:
        assert f"{skipped} of {updates} updates" in warning and "train.on_nonfinite" in warning


def test_nonfinite_stops_with_last_good_checkpoint_then_skip_mode_finishes(tmp_path):
    out = tmp_path / "run"
    stopped = run_recipe(TINY_HUMANLINE, DIVERGING + [f"output_dir={out}"], expect=3)
    assert "Traceback" not in stopped.stderr
    paragraph = stopped.stderr.strip().splitlines()[-1]
    for needle in ("Stopped at update 1", "a gradient", "not finite", "checkpoints/step_1", "train.lr",
                   "train.max_grad_norm", "bf16", "train.on_nonfinite=skip"):
        assert needle in paragraph, paragraph
    # the bad update saved nothing: step_1 (after the one good update) is the newest and was not rotated away
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_1"]
    assert (out / "checkpoints" / "step_1" / "complete.json").is_file()
    assert not (out / "final").exists() and not (out / ".final.partial").exists()
    weights = _model_states(out / "checkpoints" / "step_1")["module"]
    assert weights and all(bool(t.isfinite().all()) for t in weights.values())
    rows = read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], r["skipped"]) for r in rows] == [(0, False), (1, True)]
    assert json.loads((out / "summary.json").read_text())["exit_code"] == 3

    # a checkpoint whose weights hold a NaN (poisoned by hand here) is never exported: resumed at its last update,
    # the run goes straight to `final/` and refuses it
    poisoned = tmp_path / "poisoned"
    shutil.copytree(out, poisoned)
    state = _model_states(poisoned / "checkpoints" / "step_1")
    next(iter(state["module"].values())).view(-1)[0] = float("nan")
    torch.save(state, poisoned / "checkpoints" / "step_1" / "mp_rank_00_model_states.pt")
    refused = run_recipe(TINY_HUMANLINE, DIVERGING + [f"output_dir={poisoned}", "train.max_steps=1"], expect=3)
    assert "Refused to write `final/` at update 1" in refused.stderr and "Traceback" not in refused.stderr
    assert not (poisoned / "final").exists() and not (poisoned / ".final.partial").exists()

    resumed = run_recipe(TINY_HUMANLINE, DIVERGING + [f"output_dir={out}", "train.on_nonfinite=skip"])
    assert "Resumed from" in resumed.stdout
    rows = read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], r["skipped"], r["synced"]) for r in rows[1:]] == [(n, True, False) for n in range(1, 6)]
    assert json.loads((out / "summary.json").read_text())["skipped_updates"] == 5
    # the end-of-run summary says so, and warns (more than a quarter skipped)
    assert "6 updates (5 skipped as non-finite, 1 optimizer steps)" in resumed.stdout, resumed.stdout[-2000:]
    assert "warning: 5 of 6 updates (83%) were skipped as non-finite" in resumed.stdout
    final = load_file(str(out / "final" / "model.safetensors"))
    assert all(bool(t.isfinite().all()) for t in final.values())
    # skipped updates changed nothing: final/ holds the weights of the last good checkpoint
    for name, tensor in final.items():
        assert torch.equal(tensor, weights[name]), name


def test_a_checkpoint_that_would_run_code_is_refused(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "EXECUTED"
    step = out / "checkpoints" / "step_1"
    step.mkdir(parents=True)
    torch.save({"module": {}, "payload": RunsACommand(marker)}, step / "mp_rank_00_model_states.pt")
    (step / "complete.json").write_text("{}")
    proc = run_recipe(TINY_HUMANLINE, [f"output_dir={out}", "train.max_steps=2"], expect=2)
    assert "Traceback" not in proc.stderr
    assert "Refused to load checkpoint file" in proc.stderr and "mp_rank_00_model_states.pt" in proc.stderr
    assert "Nothing from it was run" in proc.stderr
    assert not marker.exists()


# ------------------------------------------------------------------------------- the pieces, in one process
def test_guard_flags_sum_over_ranks_and_name_the_first_quantity():
    rank0, rank1 = GuardFlags(statistics=1.0), GuardFlags(grads=1.0, signal=1.0)
    seen = GuardFlags.from_sums([a + b for a, b in zip(rank0.values(), rank1.values())])
    assert seen.nonfinite() == "grads" and seen.signal and not seen.stop_file
    assert GuardFlags().nonfinite() is None
    assert first_nonfinite({"b": float("nan"), "a": 1.0, "c": float("inf")}) == "b"


@pytest.mark.parametrize("limit, pattern, stops_at", [(3, "TTFTTT", 5), (2, "TFTFTF", None), (1, "FFT", 2)])
def test_skip_counter_stops_after_the_limit_in_a_row(limit, pattern, stops_at):
    counter = SkipCounter(limit)
    stopped = [i for i, c in enumerate(pattern) if counter.record(c == "T")]
    assert (stopped[0] if stopped else None) == stops_at


def test_nonfinite_message_names_update_quantity_and_fixes():
    text = nonfinite_message(7, "loss", "loss", "out/checkpoints/step_5", skipped_in_a_row=10)
    for needle in ("update 7", "the loss", "10 skipped updates in a row", "train.max_skipped_updates",
                   "out/checkpoints/step_5", "train.lr", "train.max_grad_norm", "bf16"):
        assert needle in text
    assert "No checkpoint was saved" in nonfinite_message(0, "statistics", None, None)
