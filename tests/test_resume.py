"""Resume reproduces the uninterrupted run's per-update losses exactly (fp32 CPU), whatever ended the first part:

* one process (plain ``python``, ZeRO-0, humanline *sampling*, whose generator state must resume too): kill -9
  while a checkpoint save hangs before its completeness marker (the half-written ``step_4`` is ignored with a
  notice and ``step_2`` is used), a torn last line of ``metrics.jsonl``, then SIGTERM mid-run (exit code 4, a
  checkpoint at the update reached), then the rest;
* two processes (``torchrun``, ZeRO-3: optimizer partitions and each rank's reference shard resume): SIGTERM to
  the whole process group mid-run (each worker exits 4; torchrun, signalled too, reports its own failure), then
  the rest;
* one process, trained by `train.epochs` on a `data.train` mixture with soft reference updates
  (`humanline.sync_mix`): SIGTERM mid-run, then the rest.

"Mid-run" is a state, not a moment: the run pauses after an update through a test callback
(``run_callbacks.PauseAfterUpdate``), the signal is sent while every rank waits there, then the run goes on.
"""

import json
import os
import signal
import time

import pytest

from helpers import REPO, TINY_HUMANLINE, read_jsonl, run_recipe, start_recipe
from run_callbacks import hang_before_complete, pause_after

COMMON = [
    "train.max_steps=6", "train.lr_schedule=linear", "train.warmup_steps=1", "eval.every=null",
    "checkpoint.save_final=false", "humanline.sync_every=2",
]


def _wait_for(condition, proc, what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _sigterm_midrun(proc, out, update: int, log, nproc: int = 1) -> str:
    """SIGTERM to the run's process group while every rank is paused after ``update`` (``pause_after``), then let it
    go on; returns its output."""
    _wait_for(lambda: all((out / f"paused_{update}_rank{r}").exists() for r in range(nproc)), proc,
              f"the pause after update {update}")
    os.killpg(proc.pid, signal.SIGTERM)
    (out / f"go_{update}").write_text("")
    proc.wait(timeout=300)
    log.seek(0)
    return log.read()


def _assert_checkpointed_at_reached_update(out, output: str) -> int:
    reached = len(read_jsonl(out / "metrics.jsonl"))
    assert 0 < reached < 6, reached
    assert f"SIGTERM received: checkpointing at update {reached} and stopping" in output, output[-3000:]
    assert (out / "checkpoints" / f"step_{reached}" / "complete.json").is_file()
    assert json.loads((out / "summary.json").read_text())["exit_code"] == 4
    return reached


def _assert_same_losses(straight, resumed):
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(6))
    assert [(r["loss"], r["lr"]) for r in a] == [(r["loss"], r["lr"]) for r in b]  # exactly: fp32 on CPU
    assert abs(a[5]["loss"] - a[0]["loss"]) > 1e-4  # the later updates really differ (not a vacuous comparison)


def test_resume_after_kill_during_save_and_sigterm_one_process(tmp_path):
    # look-ahead syncing (offline data, `humanline.reference: auto`) every 3 updates: step_2 and step_4 fall inside
    # a window whose log-probs were computed at its start, so they resume from the checkpoint's copy
    overrides = COMMON + ["engine.zero_stage=0", "humanline.transform=sample", "checkpoint.save_every=2",
                          "humanline.sync_every=3"]
    straight, out = tmp_path / "straight", tmp_path / "run"
    run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={straight}"])
    ckpts = out / "checkpoints"

    # 1. kill -9 while the save of step_4 hangs after every file and before its marker
    with open(tmp_path / "killed.log", "w+") as log:
        proc = start_recipe(TINY_HUMANLINE, overrides + [f"output_dir={out}", hang_before_complete("step_4")], log=log)
        _wait_for(lambda: (ckpts / "step_4" / "hanging").exists(), proc, "the save of step_4")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert (ckpts / "step_2" / "complete.json").is_file() and not (ckpts / "step_4" / "complete.json").exists()
    assert (ckpts / "latest").read_text() == "step_2"  # written after the marker; DeepSpeed's own is off
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "loss": 0.69')  # a row torn by a kill mid-write

    # 2. resume: step_4 is ignored (one line), step_2 used; SIGTERM mid-run -> exit 4 with a checkpoint
    with open(tmp_path / "sigterm.log", "w+") as log:
        proc = start_recipe(TINY_HUMANLINE, overrides + [f"output_dir={out}", pause_after(3)], log=log)
        output = _sigterm_midrun(proc, out, 3, log)
    assert proc.returncode == 4, output[-3000:]
    assert "Ignoring incomplete checkpoint(s) step_4" in output and "resuming from `step_2`" in output
    assert f"Resumed from {ckpts}/step_2 at update 2" in output
    reached = _assert_checkpointed_at_reached_update(out, output)

    # 3. the rest
    last = run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={out}"])
    assert f"Resumed from {ckpts}/step_{reached} at update {reached}" in last.stdout
    _assert_same_losses(straight, out)


def test_resume_after_sigterm_two_processes_zero3(tmp_path):
    overrides = COMMON + ["engine.zero_stage=3", "engine.zero3_param_persistence_threshold=100",
                          "checkpoint.save_every=null",
                          "humanline.reference=copy"]  # each rank's reference shard resumes
    straight, out = tmp_path / "straight", tmp_path / "run"
    run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={straight}"], nproc=2)
    with open(tmp_path / "sigterm.log", "w+") as log:
        proc = start_recipe(TINY_HUMANLINE, overrides + [f"output_dir={out}", pause_after(1)], nproc=2, log=log)
        output = _sigterm_midrun(proc, out, 1, log, nproc=2)
    reached = _assert_checkpointed_at_reached_update(out, output)
    assert sorted(p.name for p in (out / "checkpoints" / f"step_{reached}").glob("reference_rank*.pt")) == [
        "reference_rank00000.pt", "reference_rank00001.pt"]
    last = run_recipe(TINY_HUMANLINE, overrides + [f"output_dir={out}"], nproc=2)
    assert "Resumed from" in last.stdout
    _assert_same_losses(straight, out)


def test_stop_file_checkpoints_and_exits_cleanly(tmp_path):
    """A launcher (the SLURM time-limit trap) creates <output_dir>/STOP: the run checkpoints and exits 0."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "STOP").write_text("")
    common = [f"output_dir={out}", "train.max_steps=2", "eval.every=null", "checkpoint.save_every=null"]
    first = run_recipe(TINY_HUMANLINE, common)
    assert "STOP found" in first.stdout and "Stopped after update 0" in first.stdout
    assert (out / "checkpoints" / "step_0" / "complete.json").is_file() and not (out / "STOP").exists()
    assert not (out / "final").exists()
    second = run_recipe(TINY_HUMANLINE, common)
    assert "Resumed from" in second.stdout and (out / "final").is_dir() and not (out / ".final.partial").exists()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1]


def test_resume_with_epochs_a_mixture_and_soft_syncing(tmp_path):
    """1.5 passes over 24 + 8 pairs drawn 0.7 / 0.3 = ceil(48 / 8) = 6 updates; the reference mixed half-way to the
    policy every 2nd update (a reference copy: look-ahead cannot serve a mixture). The LR schedule runs over the
    derived 6 updates, and the SIGTERMed, resumed run repeats the straight run's losses exactly."""
    from hl_core.engines.base import lr_lambda

    prefs = "tests/fixtures/tiny/prefs"
    overrides = [
        f"data.train=[{{path: {prefs}/train.jsonl, weight: 0.7, limit: 24}}, {{path: {prefs}/extra.jsonl, weight: 0.3, "
        "limit: 8}]", "train.max_steps=null", "train.epochs=1.5", "train.lr_schedule=linear", "train.warmup_steps=1",
        "eval.every=null", "checkpoint.save_final=false", "checkpoint.save_every=null", "humanline.sync_every=2",
        "humanline.sync_mix=0.5"]
    recipe = REPO / "recipes" / "tiny" / "mixture_dpo.yaml"
    straight, out = tmp_path / "straight", tmp_path / "run"
    first = run_recipe(recipe, overrides + [f"output_dir={straight}"]).stdout
    assert "`train.epochs: 1.5` -> `train.max_steps: 6` = ceil(1.5 x 32 examples / 8 per update" in first
    assert "32 train pairs from 2 sources [" in first and "train.jsonl: 24 at weight 0.7" in first
    assert "reference log-probs: copy (look-ahead syncing does not apply: `humanline.sync_mix: 0.5`" in first
    summary = json.loads((straight / "summary.json").read_text())
    assert [s["examples"] for s in summary["data/train_sources"]] == [24, 8] and summary["updates"] == 6
    rows = read_jsonl(straight / "metrics.jsonl")
    schedule = lr_lambda(1, 6, "linear")
    assert [r["lr"] for r in rows] == pytest.approx([1e-3 * schedule(n) for n in range(6)], rel=1e-9)
    assert rows[-1]["lr"] < rows[1]["lr"] / 4  # decayed over the derived length, not a default one
    with open(tmp_path / "sigterm.log", "w+") as log:
        proc = start_recipe(recipe, overrides + [f"output_dir={out}", pause_after(2)], log=log)
        output = _sigterm_midrun(proc, out, 2, log)
    reached = _assert_checkpointed_at_reached_update(out, output)
    last = run_recipe(recipe, overrides + [f"output_dir={out}"])
    assert f"Resumed from {out / 'checkpoints'}/step_{reached} at update {reached}" in last.stdout
    _assert_same_losses(straight, out)


def test_resume_with_a_changed_training_file_is_refused_naming_it(tmp_path, capsys):
    """The checkpoint's run record keeps the training file's SHA-256: the same rows in another order refuse the
    resume (exit 2, one paragraph naming the file and both ways on); the bytes restored (a new mtime), it resumes."""
    import hashlib

    from launchers.run import main

    out, data = tmp_path / "run", tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    original = (REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text()
    data.write_text(original)
    common = [f"output_dir={out}", f"data.train.path={data}", "eval.every=null", "checkpoint.save_final=false"]
    run_recipe(TINY_HUMANLINE, [*common, "train.max_steps=2"])
    sha = hashlib.sha256(original.encode()).hexdigest()
    record = json.loads((out / "checkpoints" / "step_2" / "complete.json").read_text())["run"]
    assert record["data_train_files"] == [{"path": str(data), "files": {"train.jsonl": sha}}]
    rows = original.splitlines(True)
    data.write_text("".join(rows[1:] + rows[:1]))  # the same rows, one moved to the end
    assert main([str(TINY_HUMANLINE), *common, "train.max_steps=4", "logging.progress_bar=false"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for needle in (f"`{data}` changed since the checkpoint (SHA-256 {sha[:12]}... then", "restore the training data",
                   "`checkpoint.resume=never checkpoint.overwrite=true` here", "or another `output_dir`"):
        assert needle in err, err
    data.write_text(original)
    resumed = run_recipe(TINY_HUMANLINE, [*common, "train.max_steps=4"])
    assert f"Resumed from {out / 'checkpoints'}/step_2 at update 2" in resumed.stdout
    assert "changed since" not in resumed.stdout
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]


def test_what_a_changed_training_source_names():
    from hl_core.loop.run_record import train_data_change

    one = [{"path": "d", "files": {"a.jsonl": "1" * 64, "b.jsonl": "2" * 64}}]
    assert train_data_change(None, one) == ""  # a record from before the digests: not checked
    assert train_data_change(one, [{"path": "elsewhere", "files": dict(one[0]["files"])}]) == ""  # same bytes
    edited = [{"path": "d", "files": {"a.jsonl": "1" * 64, "b.jsonl": "3" * 64, "c.jsonl": "4" * 64}}]
    assert train_data_change(one, edited) == ("`d/b.jsonl` changed since the checkpoint (SHA-256 222222222222... then, "
                                              "333333333333... now); `d/c.jsonl` is new")
    hub = [{"path": "org/prefs", "files": {}}]
    assert train_data_change(hub, hub) == ""
    assert train_data_change(hub, [{"path": "org/other", "files": {}}]) == (
        "`data.train.path` was `org/prefs`, this run has `org/other`")
    assert train_data_change(hub + one, hub + edited).startswith("`d/b.jsonl` changed")
    assert train_data_change(hub + one, one) == "`data.train` had 2 source(s) at the checkpoint, this run has 1"
