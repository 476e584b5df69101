"""No unpickling where a user can point a path (issue 53 point 5): a payload (a pickle whose ``__reduce__`` would
``touch`` a marker file) planted in each file, one at a time, of every resumable checkpoint of the launcher's paths
and of the own-loop examples, then a resume from it: nothing runs (no marker), no traceback, and every ``.pt`` file
(and every JSON marker) is refused with one paragraph naming the file, printed by the rank that read it (exit code 2
for that rank). A file the resume never reads (DeepSpeed's ``zero_to_fp32.py``) changes nothing.

The checkpoints: the launcher's DeepSpeed engine at ZeRO-3 on 2 ranks with humanline sampling (each rank's model and
optimizer states, reference shards, generator and transform states), at ZeRO-0 on 1 rank with look-ahead syncing
(its reference log-probs), the launcher's Megatron engine at tp 2 (each rank's shard, the client state, the layout
file); the examples ``torch_dpo.py`` (one file), ``deepspeed_dpo.py`` (ZeRO-3, 2 ranks: the engine's files through
``weights_only_checkpoints``, each rank's humanline state) and ``megatron_dpo.py`` (tp 2, a file per rank). The TRL
adapter's checkpoints are tested with the adapter."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import REPO, TINY_HUMANLINE, RunsACommand, recipe_command, run_fresh, run_in_process, run_ranks

EXAMPLES = REPO / "examples"
TINY = REPO / "tests" / "fixtures" / "tiny"
PACK = ["train.max_steps=4", "checkpoint.save_every=2", "eval.every=null", "checkpoint.save_final=false",
        "logging.progress_bar=false"]
LAUNCHER = {
    "deepspeed zero-3, sampling": (2, PACK + ["engine.zero_stage=3", "humanline.transform=sample",
                                              "humanline.sync_every=2", "humanline.reference=copy"]),
    "deepspeed zero-0, look-ahead": (1, PACK + ["engine.zero_stage=0", "humanline.sync_every=3",
                                                "humanline.reference=auto"]),
    "megatron tp 2, sampling": (2, PACK + ["engine.name=megatron", "parallel.tp=2", "humanline.transform=sample",
                                           "humanline.sync_every=2"]),
}
EXAMPLE_ARGS = ["--steps", "4", "--sync-every", "2", "--model", TINY / "model", "--data",
                TINY / "prefs" / "train.jsonl"]
OWN_LOOP = {
    "torch_dpo.py": (1, ["--sample"]),
    "deepspeed_dpo.py": (2, ["--sample", "--zero", "3", "--persist-below", "1000"]),
    "megatron_dpo.py": (2, ["--sample", "--tp", "2"]),
}
ZYGOTE_CODE = re.compile(r"\[zygote\] rank (\d+) exited with code (-?\d+)")


def _run(argv, nproc: int) -> subprocess.CompletedProcess:
    return run_ranks(argv, nproc, timeout=900) if nproc > 1 else run_fresh(argv, timeout=900)


def _launch(overrides, nproc: int) -> subprocess.CompletedProcess:
    if nproc == 1:
        return run_in_process([TINY_HUMANLINE, *overrides])
    return _run(recipe_command(TINY_HUMANLINE, overrides, 1)[1:], nproc)


def _refused_by(proc) -> dict:
    """``{rank: exit code}`` of the ranks that failed (one process: rank 0 and its own code)."""
    codes = {int(r): int(c) for r, c in ZYGOTE_CODE.findall(proc.stderr)}
    return codes if codes else ({0: proc.returncode} if proc.returncode else {})


def _plant_each(root: Path, checkpoint: Path, resume, tmp_path: Path) -> dict:
    """Each file under ``checkpoint`` (inside the run directory ``root``) replaced by a payload in a copy of ``root``,
    then ``resume(copy)``; returns {file name: whether the resume refused it}."""
    files = sorted(p.relative_to(root) for p in checkpoint.rglob("*") if p.is_file())
    assert files, checkpoint
    outcome = {}
    for n, relative in enumerate(files):
        trial, marker = tmp_path / f"trial{n}", tmp_path / f"EXECUTED{n}"
        shutil.copytree(root, trial, symlinks=True)
        torch.save({"payload": RunsACommand(marker)}, trial / relative)
        proc = resume(trial)
        assert not marker.exists(), f"{relative}: the payload ran"
        assert "Traceback" not in proc.stderr, f"{relative}:\n{proc.stderr[-4000:]}"
        refused = _refused_by(proc)
        if refused:
            errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
            assert errors and all(code in (2, -15, 143, -9) for code in refused.values()), (relative, proc.stderr)
            assert 2 in refused.values() and any(relative.name in line for line in errors), (relative, errors)
        outcome[str(relative)] = bool(refused)
        shutil.rmtree(trial)
    return outcome


def _not_read(name: str) -> bool:
    """DeepSpeed's `latest` (the resumes name their tag) and its conversion scripts (`zero_to_fp32.py`, never run)."""
    return Path(name).name == "latest" or name.endswith(".py")


def _assert_every_data_file_refused(outcome: dict) -> None:
    print("\n".join(f"  {'refused' if refused else 'not read'}: {name}" for name, refused in outcome.items()))
    for name, refused in outcome.items():
        assert refused or _not_read(name), f"{name} was not refused"


@pytest.mark.parametrize("case", list(LAUNCHER))
def test_a_payload_in_any_file_of_a_launcher_checkpoint_runs_nothing(tmp_path, case):
    nproc, overrides = LAUNCHER[case]
    out = tmp_path / "run"
    proc = _launch([*overrides, f"output_dir={out}", "train.stop_after=2"], nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    checkpoint = out / "checkpoints" / "step_2"
    assert (checkpoint / "complete.json").is_file()
    outcome = _plant_each(out, checkpoint, lambda trial: _launch([*overrides, f"output_dir={trial}"], nproc),
                          tmp_path)
    _assert_every_data_file_refused(outcome)


@pytest.mark.parametrize("example", list(OWN_LOOP))
def test_a_payload_in_any_file_of_an_own_loop_checkpoint_runs_nothing(tmp_path, example):
    pytest.importorskip("megatron.core") if example.startswith("megatron") else None
    nproc, args = OWN_LOOP[example]
    script = EXAMPLES / example
    saved = tmp_path / "saved"
    proc = _run([script, *EXAMPLE_ARGS, *args, "--checkpoint", saved, "--stop-after", "2"], nproc)
    assert proc.returncode == 0, proc.stderr[-4000:]
    outcome = _plant_each(saved, saved, lambda trial: _run([script, *EXAMPLE_ARGS, *args, "--checkpoint", trial],
                                                           nproc), tmp_path)
    _assert_every_data_file_refused(outcome)
