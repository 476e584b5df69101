"""A study worker: one long-lived process that runs the study's tasks one after another, so torch, DeepSpeed and
transformers are imported once per worker instead of once per run (a run's start-up was 8-15 s of a 13-45 s run).

    python -m eval.repro.worker        # reads one JSON task per line on stdin, answers one JSON line per task

A task is ``{"argv": [...], "log": path}`` (``launchers/run.py``'s ``main(argv)``, the command line's code path) or
``{"call": "module:function", "kwargs": {...}, "log": path}`` (a function returning JSON-able data, such as writing
an offline data set). The answer carries the task's CPU seconds (``cpu_s``: this process and the children it waited
for). Everything the task prints, Python or C, goes to ``log`` (file descriptors 1 and 2 point at
it while the task runs). The answer is ``{"code": exit code, "result": ...}``; an exception is code 1 with its
traceback in the log. Between tasks the worker restores what a run may change (environment, working directory,
torch's thread count, deterministic switch and default generator, the process group), so a run gives the same
losses and curve as in a fresh process: ``tests/test_repro.py`` pins a curve measured with one process per run.
The driver starts workers with ``eval.repro.runs.child_env()`` (1 thread, AVX2 kernels, fixed hashing).
"""

from __future__ import annotations

import faulthandler
import gc
import importlib
import json
import os
import resource
import sys
from pathlib import Path

from hl_core.children import watch_parent

watch_parent()  # first, before the slow imports: this worker ends with its driver, however the driver ends

import launchers.run as launcher  # noqa: E402 (after watch_parent)
from launchers.in_process import guarded_call, restored_process_state  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
_FAULTS = []  # the file faulthandler writes to (it must stay open)


def _call(task: dict):
    if "argv" in task:
        return launcher.main([str(a) for a in task["argv"]]), None
    module, _, name = task["call"].partition(":")
    return 0, getattr(importlib.import_module(module), name)(**task.get("kwargs", {}))


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of the children it has waited for."""
    return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


def run_task(task: dict, stderr_fd: int) -> dict:
    """Run one task with fds 1 and 2 on its log; restore the process state afterwards."""
    Path(task["log"]).parent.mkdir(parents=True, exist_ok=True)
    cpu = cpu_seconds()
    with open(task["log"], "w") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            with restored_process_state():
                answer, failed = guarded_call(lambda: _call(task))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(stderr_fd, 1)
            os.dup2(stderr_fd, 2)
            os.chdir(REPO)
            gc.collect()
    code, result = answer if failed is None else (failed, None)
    return {"code": int(code or 0), "result": result, "cpu_s": cpu_seconds() - cpu}


def main() -> int:
    os.chdir(REPO)
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel; fd 1 itself goes to the log
    stderr_fd = os.dup(2)  # the worker's own stderr (between tasks)
    os.dup2(stderr_fd, 1)
    _FAULTS.append(os.fdopen(os.dup(stderr_fd), "w"))
    faulthandler.enable(file=_FAULTS[0])  # a fatal signal still says where Python was
    import hl_core.trainer  # noqa: F401 - every run's imports (torch, DeepSpeed, transformers), done before ...

    gc.collect()
    gc.freeze()  # ... their objects leave the collector's view: the collections between runs scan only the runs'
    for line in sys.stdin:
        if line.strip():
            answers.write(json.dumps(run_task(json.loads(line), stderr_fd)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
