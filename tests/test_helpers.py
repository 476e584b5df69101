"""The test helpers' in-process worker runs (``run_script_in_process``, what ``run_worker`` uses for one process):
a failing script is a failed run, and what a script patches or changes in the test process is put back."""

import subprocess
import sys

import pytest

import hl_core.logprobs.packed as packing
import hl_core.reference.store as store
from helpers import run_script_in_process, run_worker

PATCHING = """
import sys
import hl_core.logprobs.packed as packing
import hl_core.reference.store as store
packing.pack_rows = lambda *a, **k: None
store.LogpStore.fill = lambda *a, **k: 0
store.LogpStore.added_by_the_script = 1
sys.path.insert(0, "/nowhere")
print("argv", sys.argv[1:])
"""


def test_a_patching_script_leaves_the_test_process_as_it_was(tmp_path):
    script = tmp_path / "patching.py"
    script.write_text(PATCHING)
    pack_rows, fill, argv, path = packing.pack_rows, store.LogpStore.fill, sys.argv[:], sys.path[:]
    proc = run_script_in_process(script, ["a", 1])
    assert proc.returncode == 0 and "argv ['a', '1']" in proc.stdout, proc.stderr
    assert packing.pack_rows is pack_rows and store.LogpStore.fill is fill
    assert sys.argv == argv and sys.path == path


@pytest.mark.parametrize("body, code", [("raise ValueError('planted')", 1), ("import sys; sys.exit(3)", 3)])
def test_a_failing_script_is_a_failed_run(tmp_path, body, code):
    script = tmp_path / "failing.py"
    script.write_text(body + "\n")
    proc = run_script_in_process(script)
    assert isinstance(proc, subprocess.CompletedProcess) and proc.returncode == code
    assert code != 1 or "ValueError: planted" in proc.stderr
    with pytest.raises(AssertionError):
        run_worker(script)
