"""What a run leaves in its output directory and what it trusts there, in one process (no training):

* the output-directory lock (``hl_core/storage/run_lock.py``): a live holder is refused with its pid and host, a
  dead one on this host or the same SLURM job is taken over with a line, another host's is refused; only rank 0
  takes it;
* ``final/`` is replaced so that a complete one exists at every instant (an atomic swap; without one, the old
  model is put back at the next start);
* ``complete.json`` says what a checkpoint holds: a damaged one is refused, an empty one (older versions) is not;
  a model known by name only (not downloaded yet) is compared by name;
* the reference cache deletes only the part files its manifest lists, never follows a symbolic link at
  ``reference_cache/rank*`` and refuses a manifest entry naming a path outside it;
* megatron-core's warnings about missing Transformer Engine / Apex are hidden and said once;
* an ``output_dir`` that is a symbolic link is said in one line naming where it points; a link to nothing is
  refused.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from hl_core.config import load_recipe
from hl_core.errors import RecipeError
from hl_core.loop.lifecycle import begin_run
from hl_core.loop.run_record import check_resume_record, run_record
from hl_core.reference.cache import ReferenceCacheDir
from hl_core.storage import checkpoints as ckpt
from hl_core.storage.digests import sha256_file
from hl_core.storage.run_lock import LOCK_FILE, OutputDirLock


# ------------------------------------------------------------------------------------------------ the lock
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(out, **holder):
    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "since": "then", **holder}))


def test_a_live_holder_is_refused_by_pid_and_host(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, pid=sleeper.pid)
        with pytest.raises(RecipeError) as refused:
            OutputDirLock(tmp_path).acquire()
        message = str(refused.value)
        assert f"pid {sleeper.pid} on host {socket.gethostname()}" in message and "Fix:" in message
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == sleeper.pid  # untouched
    finally:
        sleeper.kill()
        sleeper.wait()
    _write_lock(tmp_path, pid=1, host="another-host")  # not checkable from here: refused, names the host
    with pytest.raises(RecipeError, match="on host another-host"):
        OutputDirLock(tmp_path).acquire()


def test_a_stale_lock_is_taken_over_with_a_line_and_released(tmp_path):
    dead = _dead_pid()
    _write_lock(tmp_path, pid=dead)
    lock = OutputDirLock(tmp_path).acquire()
    assert lock.held and f"Took over the stale lock on {tmp_path} (pid {dead}" in lock.notice
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(RecipeError, match=f"pid {os.getpid()}"):  # a second run while this one holds it
        OutputDirLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()
    fresh = OutputDirLock(tmp_path).acquire()
    assert fresh.notice == ""
    fresh.release()


def test_a_requeued_slurm_job_retakes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    # pid 1 is alive (and on another node): only the job id counts
    _write_lock(tmp_path, pid=1, host="node-that-ran-it-before", slurm_job_id="4242")
    lock = OutputDirLock(tmp_path).acquire()
    assert "SLURM job 4242" in lock.notice and "requeued" in lock.notice
    lock.release()
    _write_lock(tmp_path, pid=1, host="another-node", slurm_job_id="9999")
    with pytest.raises(RecipeError, match="SLURM job 9999"):
        OutputDirLock(tmp_path).acquire()


def _begin(recipe, world_size: int = 1, main: bool = True):
    """``begin_run`` as the trainer calls it: the recipe's ``output_dir`` and ``checkpoint`` section, its record."""
    return begin_run(Path(recipe.output_dir), recipe.checkpoint, run_record(recipe, world_size), main)


def test_only_rank_0_takes_the_lock(tmp_path):
    recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [f"output_dir={tmp_path / 'run'}"])
    other = _begin(recipe, 2, main=False)
    assert other.lock is None and not (tmp_path / "run" / LOCK_FILE).exists()
    first = _begin(recipe, 2)
    assert first.lock.held and (tmp_path / "run" / LOCK_FILE).is_file()
    first.lock.release()


# --------------------------------------------------------------------------------------------- final/
def _model_dir(path, tag):
    path.mkdir()
    (path / "config.json").write_text(tag)
    (path / "model.safetensors").write_text(tag)


def test_final_is_swapped_so_a_kill_in_the_delete_keeps_a_complete_one(tmp_path, monkeypatch):
    _model_dir(tmp_path / "final", "old")
    _model_dir(tmp_path / ".final.partial", "new")
    real = ckpt.shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # the kill lands inside the delete: one file gone, then nothing
        os.unlink(os.path.join(path, "config.json"))
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        ckpt.publish_final(tmp_path)
    assert (tmp_path / "final" / "model.safetensors").read_text() == "new"
    assert (tmp_path / "final" / "config.json").read_text() == "new"
    monkeypatch.setattr(ckpt.shutil, "rmtree", real)
    _model_dir(tmp_path / ".final.partial", "newer")
    ckpt.publish_final(tmp_path)  # the interrupted delete's leftover goes too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (tmp_path / "final" / "model.safetensors").read_text() == "newer"


def test_without_a_swap_the_old_final_is_put_back_at_the_next_start(tmp_path, monkeypatch):
    _model_dir(tmp_path / "final", "old")
    _model_dir(tmp_path / ".final.partial", "new")
    monkeypatch.setattr(ckpt, "_exchange", lambda a, b: False)  # a file system without renameat2's exchange
    real, calls = ckpt.os.replace, []

    def killed_between_renames(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", killed_between_renames)
    with pytest.raises(KeyboardInterrupt):
        ckpt.publish_final(tmp_path)
    monkeypatch.setattr(ckpt.os, "replace", real)
    assert not (tmp_path / "final").exists()
    notice = ckpt.recover_final(tmp_path)
    assert "Restored" in notice and (tmp_path / "final" / "model.safetensors").read_text() == "old"
    assert ckpt.recover_final(tmp_path) == ""


# ---------------------------------------------------------------------------------------- complete.json
def test_a_damaged_marker_is_refused_and_an_empty_one_is_an_older_versions(tmp_path):
    step = tmp_path / "step_3"
    step.mkdir()
    (step / "complete.json").write_text("")
    assert ckpt.read_marker(step) == {}
    ckpt.mark_complete(step, 3, {"objective": "dpo"})
    assert ckpt.read_marker(step) == {"updates_done": 3, "run": {"objective": "dpo"}}
    for garbage in ("\x00\x01garbage", "[1, 2]", '{"updates_done": 7}', '{"updates_done": "3"}', '{"run": 5}'):
        (step / "complete.json").write_text(garbage)
        with pytest.raises(RecipeError, match="complete.json` is damaged"):
            ckpt.read_marker(step)


def test_a_model_known_by_name_only_is_compared_by_name(tmp_path):
    """A hub model not in the local cache when a run starts has no dimensions in its record yet: compared by name
    and overrides then (a later resume knows its dimensions once it is downloaded)."""
    recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [f"output_dir={tmp_path}"])
    record = run_record(recipe, 1)
    assert record["model"]["dims"]["hidden_size"] == 64
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    ckpt.mark_complete(step, 2, {**record, "model": {**record["model"], "dims": None}})
    assert check_resume_record(step, "auto", record).notices == []
    renamed = {**record, "model": {**record["model"], "dims": None, "name_or_path": "org/other-model"}}
    ckpt.mark_complete(step, 2, renamed)
    with pytest.raises(RecipeError, match="org/other-model"):
        check_resume_record(step, "auto", record)


# ------------------------------------------------------------------------------------- the reference cache
FIELDS = {"format": 1, "model.name_or_path": "m"}


def _manifest(directory, parts, fields=FIELDS):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_text(json.dumps({"fingerprint": fields, "parts": parts}))


def test_cache_cleanup_deletes_only_its_own_listed_files(tmp_path):
    cache = tmp_path / "reference_cache" / "rank00000"
    _manifest(cache, {"eval": {"file": "eval.pt", "sha256": "x"}}, fields={"format": 1, "model.name_or_path": "old"})
    (cache / "eval.pt").write_bytes(b"old part")
    (cache / "notes.pt").write_bytes(b"a user's file")  # in the directory, but not the cache's
    opened = ReferenceCacheDir(cache, FIELDS)  # another fingerprint: the old parts go
    assert "recomputing it" in opened.notices[0]
    assert not (cache / "eval.pt").exists() and (cache / "notes.pt").read_bytes() == b"a user's file"


def test_cache_refuses_a_symlinked_rank_dir_and_a_manifest_entry_outside(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "weights.pt").write_bytes(b"unrelated")
    _manifest(outside, {}, fields={"format": 1, "model.name_or_path": "old"})
    root = tmp_path / "run" / "reference_cache"
    root.mkdir(parents=True)
    (root / "rank00000").symlink_to(outside)
    with pytest.raises(RecipeError, match="is a symbolic link"):
        ReferenceCacheDir(root / "rank00000", FIELDS)
    assert (outside / "weights.pt").read_bytes() == b"unrelated"

    cache = root / "rank00001"
    entry = {"file": "../../elsewhere/weights.pt", "sha256": sha256_file(outside / "weights.pt")}
    _manifest(cache, {"eval": entry})
    with pytest.raises(RecipeError, match="not a part file of the cache's own directory"):
        ReferenceCacheDir(cache, FIELDS)
    assert (outside / "weights.pt").read_bytes() == b"unrelated"


# ------------------------------------------------------------------------------------------ megatron's log
def test_megatron_warnings_about_missing_accelerations_are_hidden_and_said_once():
    code = ("from hl_core.engines import quiet_megatron; print(quiet_megatron())\n"
            "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs, megatron.core.models.backends")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Transformer Engine" not in proc.stderr and "Apex is not installed" not in proc.stderr, proc.stderr
    assert proc.stdout.count("megatron-core: Transformer Engine and Apex not installed") == 1, proc.stdout


def test_a_symlinked_output_dir_is_said_in_one_line_and_a_dangling_one_refused(tmp_path):
    real, link = tmp_path / "scratch" / "run", tmp_path / "run"
    real.mkdir(parents=True)
    link.symlink_to(real)
    recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [f"output_dir={link}"])
    start = _begin(recipe)
    assert (real / LOCK_FILE).is_file()  # the run's files go where the link points
    start.lock.release()
    assert start.notices == [f"`output_dir: {link}` is a symbolic link to `{real}`: the run writes there."]
    relative = tmp_path / "relative"
    relative.symlink_to("scratch/run")
    start = _begin(load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [f"output_dir={relative}"]))
    start.lock.release()
    assert start.notices == [f"`output_dir: {relative}` is a symbolic link to `scratch/run` (`{real}`): the run writes "
                             "there."]
    start = _begin(load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [f"output_dir={real}"]))
    start.lock.release()
    assert start.notices == []
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(RecipeError, match=f"is a symbolic link to `{tmp_path / 'nowhere'}`, which is not a directory"):
        _begin(load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [f"output_dir={dangling}"]))
    assert not (tmp_path / "nowhere").exists()
