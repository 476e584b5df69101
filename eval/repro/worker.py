"""A study worker: one long-lived process that runs the study's tasks one after another, so torch, DeepSpeed and
transformers are imported once per worker instead of once per run (a run's start-up was 8-15 s of a 13-45 s run).

    python -m eval.repro.worker        # reads one JSON task per line on stdin, answers one JSON line per task

A task is ``{"argv": [...], "log": path}`` (``launchers/run.py``'s ``main(argv)``, the command line's code path) or
``{"call": "module:function", "kwargs": {...}, "log": path}`` (a function returning JSON-able data, such as writing
an offline data set). Everything the task prints, Python or C, goes to ``log`` (file descriptors 1 and 2 point at
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
import sys
import traceback
from pathlib import Path

import torch

import launchers.run as launcher

REPO = Path(__file__).resolve().parents[2]
_FAULTS = []  # the file faulthandler writes to (it must stay open)


def _call(task: dict):
    if "argv" in task:
        return launcher.main([str(a) for a in task["argv"]]), None
    module, _, name = task["call"].partition(":")
    return 0, getattr(importlib.import_module(module), name)(**task.get("kwargs", {}))


def run_task(task: dict, stderr_fd: int) -> dict:
    """Run one task with fds 1 and 2 on its log; restore the process state afterwards."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    deterministic, rng = torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    result = None
    Path(task["log"]).parent.mkdir(parents=True, exist_ok=True)
    with open(task["log"], "w") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            code, result = _call(task)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except Exception:  # what the interpreter would print, and its exit code
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(stderr_fd, 1)
            os.dup2(stderr_fd, 2)
            os.chdir(REPO)
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)
            torch.use_deterministic_algorithms(deterministic)
            torch.set_rng_state(rng)
            if torch.distributed.is_available() and torch.distributed.is_initialized():  # a run that failed in setup
                if "deepspeed" in sys.modules:
                    import deepspeed.comm  # already loaded by the run (only its teardown is needed here)

                    deepspeed.comm.destroy_process_group()
                else:
                    torch.distributed.destroy_process_group()
            gc.collect()
    return {"code": int(code or 0), "result": result}


def main() -> int:
    os.chdir(REPO)
    answers = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's channel; fd 1 itself goes to the log
    stderr_fd = os.dup(2)  # the worker's own stderr (between tasks)
    os.dup2(stderr_fd, 1)
    _FAULTS.append(os.fdopen(os.dup(stderr_fd), "w"))
    faulthandler.enable(file=_FAULTS[0])  # a fatal signal still says where Python was
    for line in sys.stdin:
        if line.strip():
            answers.write(json.dumps(run_task(json.loads(line), stderr_fd)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
