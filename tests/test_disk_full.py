"""A disk that fills while the run writes (issue 39): rows of the hostile table, with their own exit code (5).

Each row makes one write fail as a full disk makes it fail, with the error its library raises there (torch's
archive writer: ``RuntimeError: [enforce fail at inline_container.cc:672] ... file write failed``; safetensors:
``SafetensorError ... No space left on device``): after creating the file, as a real write does. Three places:
a checkpoint's files, ``final/`` (written to ``.final.partial`` first) and the reference cache's precompute. The
run must exit 5 with exactly one ``error:`` paragraph naming the file, the last complete checkpoint and "free
space", and no traceback; then, the disk "freed" (the fault removed), the same command resumes and finishes.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List

import pytest
import torch

from hl_core.errors import EXIT_DISK_FULL
from hl_core.loop.guard import EXIT_DISK_FULL as GUARD_EXIT_DISK_FULL
from hostile import Row, run_row

# what torch 2.13's archive writer raised on a real full file system (a 2.5 MB tmpfs): the first error, then the
# one raised while handling it
TORCH_ENOSPC = ("basic_ios::clear: iostream error", "[enforce fail at inline_container.cc:672] . unexpected pos "
                "901376 vs 901264")
@pytest.fixture(autouse=True)
def restored_process():
    """An in-process run leaves the environment as DeepSpeed set it (RANK, LOCAL_RANK, ...), which a later test's
    `--validate` would read as a launch: the environment, threads, generators and process group put back."""
    from launchers.in_process import restored_process_state  # the study workers' own restorer

    with restored_process_state():
        yield


COMMON = ["recipes/tiny/offline_dpo.yaml", "logging.progress_bar=false", "train.max_steps=2",
          "checkpoint.save_every=1", "eval.every=null"]


def failing_torch_save(match: str) -> Callable:
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if isinstance(f, (str, Path)) and match in str(f):
            Path(f).write_bytes(b"PK")  # the file exists, cut short, as on a full disk
            try:
                raise RuntimeError(TORCH_ENOSPC[0])
            finally:
                raise RuntimeError(TORCH_ENOSPC[1])
        return real(obj, f, *args, **kwargs)

    return save


def failing_safetensors(match: str) -> Callable:
    from safetensors import SafetensorError

    def save_file(tensors, filename, *args, **kwargs):
        if match in str(filename):
            Path(filename).write_bytes(b"\0" * 8)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise AssertionError("unreachable: every safetensors write of the row fails")

    return save_file


@dataclass
class DiskRow:
    id: str
    overrides: List[str]
    target: str  # "torch.save" | "safetensors"
    match: str  # the part of the path whose write fails
    words: List[str]  # in the paragraph; "{out}" stands for the run's output_dir


DISK_ROWS = [
    DiskRow("checkpoint write", [], "torch.save", "step_2",
            ["{out}/checkpoints/step_2/", "`{out}/checkpoints/step_1`", "free space", "rerun"]),
    DiskRow("before final/", [], "safetensors", ".final.partial",
            ["{out}/.final.partial/model.safetensors", "`{out}/checkpoints/step_2`", "free space"]),
    DiskRow("reference cache precompute", ["train.cache_reference_logps=true"], "torch.save", "reference_cache",
            ["the reference cache's `{out}/reference_cache/rank00000/updates-", ".pt.partial`",
             "no checkpoint was complete yet", "free space"]),
]


@pytest.mark.parametrize("row", DISK_ROWS, ids=[r.id for r in DISK_ROWS])
def test_disk_full_is_one_paragraph_exit_5_and_a_rerun_finishes(row, tmp_path, clean_launch_env, monkeypatch,
                                                               capsys, caplog):
    from hl_core.storage import disk_full

    out = tmp_path / "run"
    files = {"out": str(out), "repo": str(Path(__file__).resolve().parents[1])}
    monkeypatch.chdir(files["repo"])
    argv = COMMON + row.overrides + [f"output_dir={out}"]
    with monkeypatch.context() as faults:
        faults.setattr(disk_full, "free_bytes", lambda path: 0)  # the disk is full: nothing free where it writes
        if row.target == "torch.save":
            faults.setattr(torch, "save", failing_torch_save(row.match))
        else:
            import transformers.modeling_utils as modeling_utils

            faults.setattr(modeling_utils, "safe_save_file", failing_safetensors(row.match))
        code, output = run_row(Row(row.id, "run", argv, []), files, monkeypatch, capsys, caplog)
    assert code == EXIT_DISK_FULL, f"exit {code!r}, expected {EXIT_DISK_FULL}:\n{output[-3000:]}"
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    for word in row.words:
        assert word.format(**files) in errors[0], (word.format(**files), errors[0])
    assert not list(out.rglob("*.pt.partial"))  # the cache's partial part is removed: its space back
    rerun, output = run_row(Row(row.id, "run", argv, []), files, monkeypatch, capsys, caplog)
    assert rerun == 0, output[-3000:]
    assert (out / "final" / "model.safetensors").is_file() and not (out / ".final.partial").exists()


def test_disk_full_exit_code_is_one_number_and_errors_are_recognised(tmp_path, monkeypatch):
    from hl_core.errors import DiskFull
    from hl_core.storage import disk_full
    from hl_core.storage.disk_full import is_disk_full, written_path

    assert EXIT_DISK_FULL == GUARD_EXIT_DISK_FULL == 5
    full = OSError(errno.ENOSPC, "No space left on device", "/x/y")
    assert is_disk_full(full) and written_path(full) == "/x/y"
    try:
        try:
            raise full
        except OSError as exc:
            raise RuntimeError("saving failed") from exc
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped) and written_path(wrapped) == "/x/y"
    assert is_disk_full(DiskFull("/c/p.partial", "the cache's")) and not is_disk_full(OSError(errno.EACCES, "no"))
    # torch's writer does not say why: a full disk only where the run writes has (almost) no space left
    assert not is_disk_full(RuntimeError(TORCH_ENOSPC[1]), tmp_path) and not is_disk_full(RuntimeError(TORCH_ENOSPC[1]))
    monkeypatch.setattr(disk_full, "free_bytes", lambda path: 1024)
    assert is_disk_full(RuntimeError(TORCH_ENOSPC[1]), tmp_path)
