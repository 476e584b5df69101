"""No process outlives its parent (issue 39): ``--rehearse``'s rank processes and the study's worker pool end when
their parent is killed with SIGTERM (sent to the parent alone, as ``timeout`` does) or SIGKILL. Each test waits on
states (the child processes exist and are at work, read from ``/proc`` through psutil), kills the parent, and
asserts by process id that no child is alive 5 s later. The parts of ``hl_core.children`` on their own: below."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import REPO, TINY_HUMANLINE, _env

DEADLINE_S = 5.0  # the acceptance: no child alive this long after the parent was killed
START_S = 180.0  # the most a child may take to be at work (a loaded 2-core machine imports torch slowly)


def wait_for(condition, timeout: float, what: str, *parents: subprocess.Popen):
    """Poll ``condition`` (a state: processes, files) until it returns something truthy; fail after ``timeout``,
    or as soon as one of ``parents`` exited."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        ended = [p.args for p in parents if p.poll() is not None]
        if ended:
            raise AssertionError(f"{ended[0]} exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


def alive(procs):
    """Those of ``procs`` still running (a zombie waiting for init to reap it is dead)."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def descendants(pid: int, marker: str):
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if marker in " ".join(p.cmdline())]
    except psutil.Error:
        return []


def kill_and_check(parent: subprocess.Popen, kids, sig: int) -> None:
    """Signal the parent alone; every one of ``kids`` (and what they started) must be gone within 5 s."""
    watched = list(kids)
    for kid in kids:
        try:
            watched += kid.children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    pids = sorted(p.pid for p in watched)
    os.kill(parent.pid, sig)
    deadline = time.monotonic() + DEADLINE_S
    while alive(watched) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p.pid for p in alive(watched)]
    parent.wait(timeout=30)
    assert not left, f"children {left} of {pids} still alive {DEADLINE_S}s after {signal.Signals(sig).name}"


def start(args, tmp_path: Path, name: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([sys.executable, *map(str, args)], cwd=REPO, env=_env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def cleanup(proc: subprocess.Popen) -> None:
    """Whatever a failed test left: the parent's group, then any straggler by pid."""
    stragglers = descendants(proc.pid, "")
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in alive(stragglers):
        p.kill()
    proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_rehearsal_and_study_workers_end_with_their_parent(tmp_path, sig):
    """Both parents at once (their start-ups overlap): ``--rehearse`` of a 4-rank ZeRO-3 world (its rank runs in a
    child), and the quick study's warm-ups in a pool of 2 workers."""
    rehearse = start([REPO / "launchers" / "run.py", TINY_HUMANLINE, f"output_dir={tmp_path / 'run'}",
                      "engine.zero_stage=3", "cluster.gpus_per_node=4", "train.global_batch_size=64",
                      "--rehearse"], tmp_path, "rehearse")
    study = start(["-m", "eval.repro", "--quick", "--jobs", "2", "--out", tmp_path / "study",
                   "--cache", tmp_path / "cache"], tmp_path, "study")
    try:
        ranks = wait_for(lambda: descendants(rehearse.pid, "hl_core.rehearsal"), START_S, "the rehearsal's rank",
                         rehearse)

        def workers_at_work():
            found = descendants(study.pid, "eval.repro.worker")
            logs = list((tmp_path / "cache").glob("warmup-*/driver.log"))
            return found if len(found) == 2 and len(logs) == 2 else None

        workers = wait_for(workers_at_work, START_S, "two study workers running their warm-ups", study)
        kill_and_check(rehearse, ranks, sig)
        kill_and_check(study, workers, sig)
        if sig == signal.SIGTERM:  # the parents ended by the signal they got, after their children
            assert rehearse.returncode == 128 + sig and study.returncode in (128 + sig, -sig)
    finally:
        cleanup(rehearse)
        cleanup(study)


# ------------------------------------------------------------------------------------------ the parts


def test_run_forwards_sigterm_and_raises_interrupted(tmp_path):
    """``children.run`` in a parent that gets SIGTERM: the child's group gets it, the parent exits 143 after."""
    script = tmp_path / "parent.py"
    child = f"import pathlib, time; pathlib.Path({str(tmp_path / 'up')!r}).write_text(''); time.sleep(600)"
    script.write_text(f"import sys\nfrom hl_core import children\nchildren.run([sys.executable, '-c', {child!r}])\n")
    parent = start([script], tmp_path, "parent")
    try:
        kid = wait_for(lambda: (tmp_path / "up").exists() and descendants(parent.pid, "time.sleep"), 60, "the child",
                       parent)
        kill_and_check(parent, kid, signal.SIGTERM)
        assert parent.returncode == 143
    finally:
        cleanup(parent)


def test_run_ends_the_child_on_timeout_and_passes_its_output():
    from hl_core import children

    done = children.run([sys.executable, "-c", "print('hi')"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "hi\n"
    with pytest.raises(subprocess.TimeoutExpired):
        children.run([sys.executable, "-c", "import time; time.sleep(600)"], timeout=0.5)


def test_die_with_parent_signal_is_set_on_linux():
    from hl_core import children

    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    probe = (
        "import ctypes, sys; from hl_core.children import die_with_parent_signal\n"
        "assert die_with_parent_signal(); value = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0); print(value.value)\n"  # PR_GET_PDEATHSIG
    )
    done = children.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=_env())
    assert done.stdout.strip() == str(int(signal.SIGKILL)), done.stderr
