"""A run's life in its output directory, on the real engine (tiny recipes, fp32 CPU, one process):

* a finished run keeps its last checkpoint and is extended by a larger ``train.max_steps``: the same per-update
  losses and learning rates as one run of that length, with look-ahead syncing (the default for offline
  humanline) and with a cached reference (only the missing updates are computed); rerun as it is, it says it is
  complete and how to extend it;
* a resume checks what the checkpoint was written with: another objective (a DPO checkpoint as KTO), model
  width, precision (fp32 -> bf16) or number of examples per update, fewer updates than done, a damaged
  ``complete.json``, other training data: refused before any weights load (exit 2, one paragraph); the same data
  from another path with another seed, another split of the same examples into micro-batches and a garbage
  ``latest`` work, each said in a line;
* dropout (``attention_dropout: 0.1``) reproduces: look-ahead equals a reference copy, a resumed run equals an
  uninterrupted one, held-out evaluations (dropout off) are equal for equal weights and do not change training;
* ``train.on_nonfinite: skip`` with every update skipped writes no ``final/`` (exit 3);
* ``checkpoint.resume: never`` in a directory holding another run is refused; ``checkpoint.overwrite`` removes
  that run first; the summary names only what was written and records the version and commit;
* a second run on a directory in use is refused naming the holder; SIGTERM during the post-training evaluation
  leaves ``summary.json`` with exit code 143, not 0; a log file gets plain lines, not progress-bar repaints.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from helpers import REPO, TINY_HUMANLINE, TINY_OFFLINE, _env, read_jsonl, run_recipe
from launchers.run import main
from run_callbacks import pause_after

FAST = ["eval.every=null", "logging.progress_bar=false"]
DROPOUT = ["model.config_overrides={attention_dropout: 0.1}", "train.max_steps=4", "checkpoint.save_final=false",
           "humanline.sync_every=2", "train.lr_schedule=linear"]


def _losses(out):
    return [(r["step"], r["loss"], r["lr"]) for r in read_jsonl(out / "metrics.jsonl")]


def _refused(capsys, overrides, *needles):
    """A resume the run refuses in setup, before any engine is built (in this process: nothing else runs)."""
    assert main([str(TINY_HUMANLINE), *overrides, "logging.progress_bar=false"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Fix:" in err and len(err.strip().splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def test_a_finished_lookahead_run_is_extended_exactly_and_changes_are_checked(tmp_path, capsys):
    out, straight = tmp_path / "run", tmp_path / "straight"
    common = [f"output_dir={out}", "eval.every=3", "logging.progress_bar=false"]  # checkpoints every 20 (_tiny.yaml)
    run_recipe(TINY_HUMANLINE, [*common, "train.max_steps=3"])
    step3 = out / "checkpoints" / "step_3"
    assert json.loads((step3 / "complete.json").read_text())["run"]["objective"] == "dpo"

    # refused before anything is built: each names what changed and the fix
    _refused(capsys, [*common, "train.max_steps=6", "objective=kto"], "`objective.name` was dpo, this run has kto")
    _refused(capsys, [*common, "train.max_steps=6", "model.config_overrides={hidden_size: 128}"],
             '"hidden_size": 64', '"hidden_size": 128')
    _refused(capsys, [*common, "train.max_steps=6", "engine.precision=bf16"], "`engine.precision` was fp32")
    _refused(capsys, [*common, "train.max_steps=6", "train.micro_batch_size=4"], "was 8, this run has 4")
    _refused(capsys, [*common, "train.max_steps=2"], "holds 3 updates, more than this run's `train.max_steps: 2`")
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    (damaged / "checkpoints" / "step_3" / "complete.json").write_text("{not json")
    _refused(capsys, [f"output_dir={damaged}", "train.max_steps=6"], "complete.json` is damaged")

    # refused: other training data (the same rows in another order)
    data, copy = tmp_path / "train.jsonl", tmp_path / "copy" / "train.jsonl"
    data.write_text("".join(reversed((REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text().splitlines(True))))
    _refused(capsys, [*common, "train.max_steps=6", f"data.train.path={data}"], "which was trained on other data",
             f"this run has `{data}` (SHA-256", "restore the training data", "`checkpoint.resume=never")

    # allowed: the same data from another path with another seed, the same 8 examples per update as 2 x 4, a
    # garbage `latest` (never read)
    changed = tmp_path / "changed"
    shutil.copytree(out, changed)
    (changed / "checkpoints" / "latest").write_text("\x00garbage")
    copy.parent.mkdir()
    shutil.copy(REPO / "tests/fixtures/tiny/prefs/train.jsonl", copy)
    moved = run_recipe(TINY_HUMANLINE, [f"output_dir={changed}", "train.max_steps=4", f"data.train.path={copy}",
                                        "train.seed=7", "train.micro_batch_size=4",
                                        "train.gradient_accumulation_steps=2", *FAST])
    assert "The training data's settings or path, or `train.seed`, changed" in moved.stdout
    assert "look-ahead log-probs do not cover what this run reads from update 3" in moved.stdout
    assert f"Resumed from {changed}/checkpoints/step_3 at update 3" in moved.stdout
    assert [r["step"] for r in read_jsonl(changed / "metrics.jsonl")] == [0, 1, 2, 3]

    # extended: equal to one 6-update run
    extended = run_recipe(TINY_HUMANLINE, [*common, "train.max_steps=6"])
    assert f"Resumed from {step3} at update 3" in extended.stdout
    assert "`train.max_steps` is 6 (the checkpoint's run had 3): continuing from update 3" in extended.stdout
    run_recipe(TINY_HUMANLINE, [f"output_dir={straight}", "eval.every=3", "logging.progress_bar=false",
                                "train.max_steps=6"])
    assert _losses(out) == _losses(straight) and len(_losses(out)) == 6
    assert read_jsonl(out / "eval.jsonl") == read_jsonl(straight / "eval.jsonl")

    # rerun as it is: nothing to train, says so and how to extend
    again = run_recipe(TINY_HUMANLINE, [*common, "train.max_steps=6"])
    assert f"`{out}` already holds a finished run of 6 updates" in again.stdout
    assert "`train.max_steps=<more than 6>`" in again.stdout and "updates in" not in again.stdout
    assert json.loads((out / "summary.json").read_text())["updates"] == 6  # the finished run's summary, kept


def test_a_cached_reference_is_extended_by_the_missing_updates_only(tmp_path):
    out, straight = tmp_path / "run", tmp_path / "straight"
    common = ["train.cache_reference_logps=true", "train.micro_batch_size=2", "checkpoint.save_final=false", *FAST]
    run_recipe(TINY_OFFLINE, [*common, f"output_dir={out}", "train.max_steps=2", "checkpoint.save_every=2"])
    cache = out / "reference_cache" / "rank00000"
    assert list(json.loads((cache / "manifest.json").read_text())["parts"]) == ["updates-000000-000001"]
    extended = run_recipe(TINY_OFFLINE, [*common, f"output_dir={out}", "train.max_steps=4", "checkpoint.save_every=2"])
    assert "recomputing" not in extended.stdout and "Resumed from" in extended.stdout
    assert list(json.loads((cache / "manifest.json").read_text())["parts"]) == ["updates-000000-000003"]
    assert sorted(p.name for p in cache.iterdir()) == ["manifest.json", "updates-000000-000003.pt"]
    run_recipe(TINY_OFFLINE, [*common, f"output_dir={straight}", "train.max_steps=4"])
    assert _losses(out) == _losses(straight)


def test_dropout_runs_reproduce(tmp_path):
    copy, resumed = tmp_path / "copy", tmp_path / "resumed"
    # a reference copy, evaluated at 0 and 4 only
    run_recipe(TINY_HUMANLINE, [*DROPOUT, f"output_dir={copy}", "humanline.reference=copy", "eval.every=4",
                                "checkpoint.save_every=null", "logging.progress_bar=false"])
    # look-ahead, evaluated at 0, 2 and 4, stopped after 2 updates and resumed
    lookahead = [*DROPOUT, f"output_dir={resumed}", "eval.every=2", "checkpoint.save_every=null",
                 "logging.progress_bar=false"]
    run_recipe(TINY_HUMANLINE, [*lookahead, "train.stop_after=2"])
    assert "Resumed from" in run_recipe(TINY_HUMANLINE, lookahead).stdout
    a, b = read_jsonl(copy / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    keys = ("step", "loss", "lr", "grad_norm", "rewards/margin", "policy/margin")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]  # exactly: fp32 on CPU
    assert len({r["loss"] for r in a}) == 4  # it trains: not a vacuous comparison
    evals_a, evals_b = read_jsonl(copy / "eval.jsonl"), read_jsonl(resumed / "eval.jsonl")
    assert [e["step"] for e in evals_a] == [0, 4] and [e["step"] for e in evals_b] == [0, 2, 4]
    assert evals_a[0] == evals_b[0] and evals_a[1] == evals_b[2]  # the same weights, the same numbers


def test_a_run_whose_every_update_was_skipped_writes_no_final(tmp_path):
    out = tmp_path / "run"
    proc = run_recipe(TINY_HUMANLINE, [f"output_dir={out}", "train.max_steps=2", "objective.beta=1e38",
                                       "train.on_nonfinite=skip", "checkpoint.save_every=null", *FAST], expect=3)
    assert [r["skipped"] for r in read_jsonl(out / "metrics.jsonl")] == [True, True]
    assert "Refused to write `final/`: none of the run's 2 updates took an optimizer step" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "final").exists() and not (out / ".final.partial").exists()
    assert json.loads((out / "summary.json").read_text())["exit_code"] == 3


def test_resume_never_in_a_used_directory_is_refused_or_overwrites(tmp_path, capsys):
    out = tmp_path / "run"
    other = out / "checkpoints" / "step_10"  # another run's newer checkpoint and final model
    other.mkdir(parents=True)
    (other / "mp_rank_00_model_states.pt").write_text("")
    (other / "complete.json").write_text("{}")
    (out / "final").mkdir()
    common = [f"output_dir={out}", "checkpoint.resume=never", "train.max_steps=3", "checkpoint.save_every=1",
              "checkpoint.save_final=false"]
    _refused(capsys, common, "`checkpoint.resume: never` starts afresh", "`checkpoints/step_10`, `final`",
             "checkpoint.overwrite=true")
    assert other.is_dir() and (out / "final").is_dir()
    proc = run_recipe(TINY_HUMANLINE, [*common, "checkpoint.overwrite=true", *FAST])
    assert "`checkpoint.overwrite`: deleted the other run's step_10, final" in proc.stdout
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_2", "step_3"]  # rotation: its own
    outputs, plot = proc.stdout.strip().splitlines()[-2:]
    assert outputs == f"outputs: {out}/metrics.jsonl, checkpoints/"  # no final/
    assert plot == f"plot: python -m eval.report {out} -o {out}/report"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["version"] and len(summary["git_commit"] or "") == 40 and summary["exit_code"] == 0


def _command(out, *overrides):
    """The launcher without the helpers' `logging.progress_bar=false`: the default decides (a log file: no bar)."""
    return [sys.executable, str(REPO / "launchers" / "run.py"), str(TINY_HUMANLINE), f"output_dir={out}", *overrides]


def test_one_run_per_directory_and_sigterm_during_the_post_training_eval(tmp_path):
    out, data = tmp_path / "run", tmp_path / "quality.jsonl"
    data.write_text((REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text() * 64)  # a long evaluation (killed)
    overrides = ["train.max_steps=3", "eval.every=null", "checkpoint.save_every=null", "eval.data_quality.enabled=true",
                 f"eval.data_quality.data={data}", "eval.data_quality.batch_size=1"]
    log_path = tmp_path / "first.log"
    with open(log_path, "w+") as log:
        # the first run holds the directory while it waits after update 1 (a test callback), until the test lets go
        first = subprocess.Popen(_command(out, *overrides, pause_after(1)), cwd=REPO, stdout=log,
                                 stderr=subprocess.STDOUT, text=True, env=_env(), start_new_session=True)
        deadline = time.monotonic() + 300
        while not (out / "paused_1_rank0").exists():
            assert first.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        second = subprocess.run(_command(out, *overrides, "logging.progress_bar=false"), cwd=REPO, env=_env(),
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by another run (pid {first.pid} on host" in second.stderr
        assert "Traceback" not in second.stderr
        (out / "go_1").write_text("")
        # the line is printed before the evaluations start; 32k rows one at a time take far longer than the signal
        while "post-training evals: data_quality" not in log_path.read_text():
            assert first.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=120)
        output = log_path.read_text()
    assert first.returncode == 128 + signal.SIGTERM, output[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_code"] == 143 and summary["post_training_eval"] == "interrupted by SIGTERM"
    assert "SIGTERM received during the post-training evaluations" in output
    assert (out / "final" / "model.safetensors").is_file() and not (out / ".lock").exists()
    assert "\r" not in output and '{"step": 2, "loss"' in output  # a log file: plain lines, no bar repaints
