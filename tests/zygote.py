"""A parent with the heavy imports done, that forks one rank of a multi-process test run per request.

``torch.distributed.run --nproc_per_node 2 SCRIPT`` costs a test about 14 CPU seconds before the script does
anything: the agent and each worker start an interpreter and import torch, DeepSpeed and transformers. The suite
starts dozens of such runs. ``tests/helpers.run_ranks`` instead asks one zygote per rank (each its own interpreter,
so each rank still has its own hash seed and ``random`` state, as under torchrun) to fork a child that runs the
script as ``__main__`` with the rank's environment, exactly as torchrun's worker would: a real process, a real
process group over gloo, the engine under test untouched. Only the launcher differs, and the launcher has tests of
its own on the real ``torchrun`` (``HL_TEST_ZYGOTES=0`` puts every run back on it). A test that needs a fresh
process of its own (the fake process group, dynamo's caches are process-wide) gets one the same way
(``helpers.run_fresh``).

Protocol, one JSON object per line: a request on stdin (``argv``, ``env``, ``cwd``, ``stdout``, ``stderr``: two
file paths the child appends to); the zygote answers ``{"pid": ...}`` once the child is forked and
``{"code": ...}`` when it has exited (a negative code: killed by that signal). EOF on stdin ends the zygote.

Fork-safety: the zygote imports modules only (no thread is started, no OpenMP region runs: it checks that it has
one thread before it serves), so a child starts from a quiet copy of it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import List, Optional, Sequence

PRELOAD = ("torch", "torch.distributed", "deepspeed", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.models.qwen2.modeling_qwen2", "megatron.core", "launchers.run", "hl_core.trainer")


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _child(request: dict) -> int:
    """In the forked child: the rank's files, environment, argv and cwd, then the script as ``__main__``."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` puts it
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as exc:  # the script's own exit code, as the interpreter turns it into one
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - a script's uncaught error: its traceback and exit code 1, as python's
        traceback.print_exc()
        return 1


def serve() -> int:
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol; anything else printed goes to the log
    os.dup2(2, 1)
    from hl_core.engines import quiet_megatron  # as `build_engine` does, before megatron-core is imported

    quiet_megatron()
    for name in PRELOAD:
        importlib.import_module(name)
    if _threads() != 1:
        print(f"zygote: {_threads()} threads after the imports; forking would not be safe", file=sys.stderr)
        return 3
    gc.freeze()  # the imports' objects: never scanned again by a child's collections (nor copied by them)
    print(json.dumps({"ready": os.getpid()}), file=answers)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()  # only the zygote answers: its end of the pipe closes when it exits
            code = _child(request)
            atexit._run_exitfuncs()  # as at the end of `python SCRIPT`, less the teardown of every module ...
            for obj in gc.get_objects():  # ... which would flush the files a script left open
                if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                    try:
                        obj.flush()
                    except (OSError, ValueError):
                        pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(json.dumps({"pid": pid}), file=answers)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=answers)
    return 0


# ------------------------------------------------------------------------------------------------ the test's side
class Zygote:
    """One zygote process (started with ``env``), its answers read line by line from an unbuffered pipe."""

    def __init__(self, env: dict, cwd: str, log: str):
        with open(log, "ab") as errors:  # its import warnings; a zygote that fails to start says why in it
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], cwd=cwd, env=env, bufsize=0,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
        self.log, self.pending = log, b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def has_line(self) -> bool:
        return b"\n" in self.pending

    def read_line(self, timeout: float) -> Optional[dict]:
        """The next answer, or None after ``timeout`` seconds without one."""
        deadline = time.monotonic() + timeout
        while not self.has_line():
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"the zygote exited ({self.proc.wait()}): {Path(self.log).read_text()[-3000:]}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def fork(self, request: dict) -> int:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        return self.read_line(60)["pid"]


class Ranks:
    """The zygotes of one test process, one per rank, started when a run first needs them."""

    def __init__(self, env: dict, cwd: str):
        self.env, self.cwd, self.zygotes = env, cwd, []
        self.logs = tempfile.mkdtemp(prefix="hl-zygotes-")

    def get(self, n: int) -> List[Zygote]:
        self.zygotes += [None] * (n - len(self.zygotes))
        started = []
        for rank in range(n):
            if self.zygotes[rank] is None or not self.zygotes[rank].alive():
                self.zygotes[rank] = Zygote(self.env, self.cwd, os.path.join(self.logs, f"rank{rank}.log"))
                started.append(rank)
        for rank in started:  # side by side: each imports for several seconds
            if "ready" not in (self.zygotes[rank].read_line(300) or {}):
                raise RuntimeError(f"zygote {rank} did not start: {Path(self.zygotes[rank].log).read_text()[-3000:]}")
        return self.zygotes[:n]

    def run(self, argv: Sequence, env: dict, nproc: int, port: Optional[int],
            timeout: float) -> subprocess.CompletedProcess:
        """``argv`` (a script and its arguments) as ranks 0..nproc-1 of one job, as ``torchrun --nproc_per_node``
        runs it: the rendezvous variables set, the ranks' output interleaved into one stdout and one stderr, the
        other ranks stopped when one fails, exit code 0 or (a rank failed) 1. ``port`` None: one process as
        ``python SCRIPT`` runs it (no rendezvous variables, its own exit code)."""
        zygotes = self.get(nproc)
        argv = [str(a) for a in argv]
        with tempfile.TemporaryDirectory(prefix="hl-ranks-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            pids, codes = [], {}
            try:
                for rank, zygote in enumerate(zygotes):
                    rank_env = env if port is None else {
                        **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                        "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
                        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc)}
                    pids.append(zygote.fork({"argv": argv, "env": rank_env, "cwd": self.cwd, "stdout": out,
                                             "stderr": err}))
                deadline = time.monotonic() + timeout
                while len(codes) < nproc and time.monotonic() < deadline:
                    for rank, zygote in enumerate(zygotes):
                        answer = None if rank in codes else zygote.read_line(0.2)
                        if answer is not None:
                            codes[rank] = answer["code"]
                            if answer["code"] != 0:  # as torchrun: a failed rank stops the others
                                _stop([p for r, p in enumerate(pids) if r not in codes])
                timed_out = len(codes) < nproc
            finally:  # a timeout, or an error here: no rank outlives the call
                left = [r for r in range(len(pids)) if r not in codes]
                _stop([pids[r] for r in left], grace=0)
                for rank in left:  # the zygote reports the killed child
                    codes[rank] = (zygotes[rank].read_line(30) or {}).get("code")
            stdout, stderr = (Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err))
        if timed_out:
            raise subprocess.TimeoutExpired(argv, timeout, output=stdout, stderr=stderr)
        if port is None:
            return subprocess.CompletedProcess(argv, codes[0], stdout, stderr)
        failed = {r: c for r, c in sorted(codes.items()) if c != 0}
        stderr += "".join(f"[zygote] rank {r} exited with code {c}\n" for r, c in failed.items())
        return subprocess.CompletedProcess(argv, 1 if failed else 0, stdout, stderr)


def _running(pid: int) -> bool:
    """``pid`` is alive (a zombie its zygote has not reaped yet is not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rpartition(")")[2].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    except (PermissionError, OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _stop(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL to each of ``pids`` still running ``grace`` seconds later (waiting on the processes,
    not a fixed sleep: no wait at all when they end at once)."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0)):
        if sig == signal.SIGTERM and not grace:
            continue
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.02)


if __name__ == "__main__":
    sys.exit(serve())  # the repository is on PYTHONPATH (``helpers._env``), as for every test subprocess
