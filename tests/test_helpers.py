"""The test helpers' in-process worker runs (``run_script_in_process``, what ``run_worker`` uses for one process):
a failing script is a failed run, and what a script patches or changes in the test process is put back; the
rendezvous ports of two pytest-xdist workers never meet; the zygotes' runs (``run_ranks``, ``run_fresh``) behave as
torchrun's and python's."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import hl_core.logprobs.packed as packing
import hl_core.reference.store as store
from helpers import REPO, ZYGOTES, free_port, run_fresh, run_ranks, run_script_in_process, run_worker

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


def test_free_ports_are_this_workers_own_and_below_the_ephemeral_range():
    """Each call a new port nothing is bound to, from this worker's block of 1000 (another worker's block never
    overlaps it), below the ports the kernel hands to outgoing connections."""
    ports = [free_port() for _ in range(3)]
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw-1")[2:])
    assert len(set(ports)) == 3 and all(10000 + 1000 * (worker + 1) <= p < 11000 + 1000 * (worker + 1) for p in ports)
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.exists() else 32768
    assert max(ports) < low
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free: raises if anything holds it


def test_two_workers_get_disjoint_ports():
    """The blocks come from the worker's id (``gw0``, ``gw1``), read when ``helpers`` is imported."""
    code = "import sys; sys.path.insert(0, 'tests'); from helpers import free_port; print(free_port())"
    got = [int(subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTEST_XDIST_WORKER": w}).stdout) for w in ("gw0", "gw1")]
    assert got[0] // 1000 == 11 and got[1] // 1000 == 12


# ------------------------------------------------------------------------------------------ the zygotes
RANK_SCRIPT = r"""
import os, sys, time
rank = int(os.environ["RANK"])
print("rank", rank, "of", os.environ["WORLD_SIZE"], "port", os.environ["MASTER_PORT"], "hash", hash("humanline"))
left_open = open(sys.argv[1] + f".rank{rank}", "w")
left_open.write("written, never closed")  # a normal exit flushes it: so must a zygote's child
if sys.argv[2] == "fail" and rank == 1:
    sys.exit(5)
if sys.argv[2] in ("fail", "hang"):
    time.sleep(600)
import torch.distributed as dist
dist.init_process_group("gloo")
t = __import__("torch").tensor([rank + 1.0])
dist.all_reduce(t)
print(f"sum {t.item()}\n", end="")  # one write: the ranks share one stdout, as under torchrun
dist.destroy_process_group()
"""


@pytest.mark.skipif(not ZYGOTES, reason="HL_TEST_ZYGOTES=0: every run starts a fresh interpreter")
def test_zygote_ranks_are_processes_of_one_job_each_with_its_own_hash_seed(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    proc = run_ranks([script, tmp_path / "out", "ok"], 2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line.split() for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert [(w[1], w[3]) for w in lines] == [("0", "2"), ("1", "2")] and lines[0][5] == lines[1][5]  # one job, one port
    assert lines[0][7] != lines[1][7]  # two interpreters' hash seeds, as under torchrun
    assert proc.stdout.count("sum 3.0") == 2  # a real gloo all-reduce between the two processes
    assert all((tmp_path / f"out.rank{r}").read_text() == "written, never closed" for r in (0, 1))


@pytest.mark.skipif(not ZYGOTES, reason="HL_TEST_ZYGOTES=0: every run starts a fresh interpreter")
def test_a_failing_rank_stops_the_others_and_a_timeout_kills_them(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    proc = run_ranks([script, tmp_path / "out", "fail"], 2, timeout=120)  # rank 0 sleeps: stopped, not waited for
    assert proc.returncode == 1 and "rank 1 exited with code 5" in proc.stderr and "rank 0 exited with code -15" in \
        proc.stderr, proc.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        run_ranks([script, tmp_path / "out", "hang"], 2, timeout=3)
    proc = run_ranks([script, tmp_path / "out", "ok"], 2, timeout=120)  # the zygotes serve the next job
    assert proc.returncode == 0 and proc.stdout.count("sum 3.0") == 2, proc.stderr


def test_a_fresh_process_has_its_own_exit_code_and_no_rendezvous(tmp_path):
    script = tmp_path / "fresh.py"
    script.write_text("import os, sys\nprint('RANK' in os.environ, sys.argv[1:])\nraise SystemExit(4)\n")
    proc = run_fresh([script, "a", 1])
    assert proc.returncode == 4 and proc.stdout.split() == ["False", "['a',", "'1']"], proc.stderr
