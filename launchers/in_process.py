"""``launchers/run.py``'s ``main()`` called inside a longer-lived process (the study's workers, the test suite), as
the command line would run it: what a run may change in its process is put back afterwards, and what it raises
becomes the exit code a process would have ended with."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Any, Callable, Iterator, Optional, Tuple

import torch


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """Restore, on the way out: the environment, torch's thread count, deterministic switch and default generator's
    state, and the process group (a run that failed in its setup leaves one up)."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    deterministic, rng = torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.set_rng_state(rng)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            destroy_process_group()


def destroy_process_group() -> None:
    """Tear the default process group down; through DeepSpeed's communication backend when a DeepSpeed engine set
    one up, so that its cached groups go too (a later DeepSpeed engine in this process would find them stale)."""
    ds_comm = sys.modules.get("deepspeed.comm")  # loaded by a DeepSpeed engine; never imported here for nothing
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def guarded_call(fn: Callable[[], Any]) -> Tuple[Any, Optional[int]]:
    """``(fn(), None)``; or, when it raises, ``(None, code)`` with the exit code the interpreter would end on:
    SystemExit's own, or 1 for a crash (its traceback printed on stderr)."""
    try:
        return fn(), None
    except SystemExit as exc:
        return None, exc.code if isinstance(exc.code, int) else 1
    except Exception:
        traceback.print_exc()
        return None, 1
