"""Child processes that never outlive their parent (``--rehearse``'s ranks, the study's workers, the benches).

A child started here:

* leads a process group of its own, so ending it ends whatever it started too (``end``: SIGTERM to the group,
  SIGKILL after ``GRACE_S``, on every exit path of ``run`` and of its callers' ``finally``);
* gets SIGKILL from the kernel when the parent thread that started it dies, SIGKILL included (Linux
  ``prctl(PR_SET_PDEATHSIG)``, set between fork and exec; only from the main thread, whose end is the process's);
* holds the read end of a pipe whose only write end is the parent's: a Python child that calls ``watch_parent()``
  first thing kills its own group when that pipe reads end-of-file, whatever ended the parent and from whichever
  thread the child was started (the study's pool starts workers from its threads);
* under ``run``, in the main thread: a SIGTERM or SIGINT to the parent alone (``timeout``, ``kill PID``) is forwarded
  to the child's group; once the child ended (SIGKILL after ``GRACE_S``), the parent exits too: ``Interrupted``,
  a ``SystemExit`` with 128 + the signal, so its own ``finally`` blocks run.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Dict, Optional, Sequence

LIFELINE_ENV = "HL_PARENT_LIFELINE_FD"  # the read end of the lifeline pipe, in a child started by ``popen``
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GRACE_S = 2.0  # after SIGTERM, the seconds a child's group has to end before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT)
_LIFELINES: Dict[int, int] = {}  # child pid -> the write end of its lifeline pipe (closed once it ended)
_LIBC: list = []  # the C library, opened in the parent (a forked child only calls into it)


class Interrupted(SystemExit):
    """The parent got ``signum`` while its child ran; the child's group has ended. Exit code 128 + the signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


def die_with_parent_signal(sig: int = signal.SIGKILL) -> bool:
    """Linux: the kernel sends ``sig`` to this process when the thread that started it ends. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if not _LIBC:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        return _LIBC[0].prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _in_child(parent_pid: int):
    """What a child runs between fork and exec (``preexec_fn``): its death signal, then a look whether the
    parent already died before that (the child then belongs to init, and must not run on)."""

    def setup() -> None:
        die_with_parent_signal()
        if os.getppid() != parent_pid:
            os._exit(137)

    return setup


def popen(cmd: Sequence[str], env: Optional[Dict[str, str]] = None, pass_fds: Sequence[int] = (),
          **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, ...)`` in the parent's care (the module's docstring): its own process group, the
    death signal (from the main thread), the lifeline pipe. End it with ``end``."""
    read_end, write_end = os.pipe()  # neither inherited (O_CLOEXEC); the child gets the read end only
    env = dict(os.environ if env is None else env)
    env[LIFELINE_ENV] = str(read_end)
    main = threading.current_thread() is threading.main_thread()
    if main and sys.platform.startswith("linux") and not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))  # opened here, not between fork and exec
    try:
        proc = subprocess.Popen(list(cmd), env=env, pass_fds=tuple(pass_fds) + (read_end,), start_new_session=True,
                                preexec_fn=_in_child(os.getpid()) if main else None, **kwargs)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    _LIFELINES[proc.pid] = write_end
    return proc


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def end(proc: subprocess.Popen, grace: float = GRACE_S) -> Optional[int]:
    """End ``proc`` and its process group: SIGTERM, SIGKILL after ``grace`` seconds; whatever of the group
    outlived the child gets SIGKILL too. Returns the child's exit code. Safe to call again."""
    return end_all([proc], grace)[0]


def end_all(procs: Sequence[subprocess.Popen], grace: float = GRACE_S) -> list:
    """``end`` for several children at once: SIGTERM to every group, one shared ``grace``, then SIGKILL."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        _kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes = []
    for proc in procs:
        _kill_group(proc.pid, signal.SIGKILL)  # the group leader gone, its group may live on
        codes.append(proc.wait())
        write_end = _LIFELINES.pop(proc.pid, None)
        if write_end is not None:
            os.close(write_end)
    return codes


def run(cmd: Sequence[str], timeout: Optional[float] = None, capture_output: bool = False, text: bool = False,
        input=None, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, ...)`` in the parent's care: the child ends with its parent, on every path (an
    exception, a timeout: ``subprocess.TimeoutExpired`` as ``subprocess.run`` raises it), and a SIGTERM/SIGINT to
    the parent is forwarded to the child's group, which gets ``GRACE_S`` seconds before SIGKILL; then
    ``Interrupted`` (exit 128 + the signal) is raised here."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = popen(cmd, text=text, **kwargs)
    received = []
    previous = {}

    def forward(signum, _frame):
        if not received:
            received.append(signum)
            _kill_group(proc.pid, signum)
            timer = threading.Timer(GRACE_S, _kill_group, (proc.pid, signal.SIGKILL))
            timer.daemon = True
            timer.start()

    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        end(proc)
        raise subprocess.TimeoutExpired(exc.cmd, exc.timeout, *_outputs(proc)) from None
    finally:
        end(proc)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise Interrupted(received[0])
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _outputs(proc: subprocess.Popen):
    """What a timed-out child had written (``subprocess.run``'s ``TimeoutExpired`` carries it)."""
    try:
        return proc.communicate(timeout=GRACE_S)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        return None, None


def watch_parent() -> bool:
    """In a Python child started by ``popen``, first thing: when the parent ends (its lifeline pipe reads
    end-of-file), kill this process's group. The death signal is set again here (a ``python -m`` child started
    without ``preexec_fn``, from a thread, keeps only this watch). False where this process has no lifeline."""
    raw = os.environ.pop(LIFELINE_ENV, None)  # not handed down: a grandchild has no such descriptor
    if raw is None or not raw.isdigit():
        return False
    fd = int(raw)

    def wait_for_end() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        if os.getpgrp() == os.getpid():
            _kill_group(os.getpid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_for_end, name="hl-parent-lifeline", daemon=True).start()
    return True


def terminate_on_sigterm() -> None:
    """In a parent's main thread: SIGTERM raises ``Interrupted`` (``SystemExit``), as SIGINT raises
    ``KeyboardInterrupt``, so the ``finally`` blocks that end its children run on that path too."""

    def stop(signum, _frame):
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, stop)
