"""Joining the process group: a rank that waits for its peers says what it waits for.

``init_process_group`` blocks, silently, until every rank of ``WORLD_SIZE`` has reached ``MASTER_ADDR:MASTER_PORT``
or its timeout passes (DeepSpeed's: ``DEEPSPEED_TIMEOUT`` minutes, 10 by default; torch's: 30 min, 10 for NCCL).
A rank still waiting ``NOTICE_AFTER_S`` seconds into it prints one line on stderr naming its rank, the address,
the world size and the timeout, and what to do.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from datetime import timedelta
from typing import Iterator

NOTICE_AFTER_S = 10.0  # a rendezvous of ranks started together takes well under this


def _duration(timeout: timedelta) -> str:
    seconds = int(timeout.total_seconds())
    return f"{seconds // 60} min" if seconds % 60 == 0 else f"{seconds} s"


def waiting_notice(timeout: timedelta, source: str, after_s: float = NOTICE_AFTER_S, environ=os.environ) -> str:
    """The line a rank prints when it has waited ``after_s`` seconds for its peers (``environ``: the launcher's
    variables; ``source``: where the timeout comes from)."""
    rank, world = environ.get("RANK", "0"), environ.get("WORLD_SIZE", "1")
    address = f"{environ.get('MASTER_ADDR', '?')}:{environ.get('MASTER_PORT', '?')}"
    return (f"rank {rank} of WORLD_SIZE={world} has waited {after_s:.0f} s for the other ranks at {address} "
            f"(MASTER_ADDR:MASTER_PORT); it gives up after {_duration(timeout)} ({source}). Every rank must start "
            f"with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (`torchrun --nproc_per_node {world} "
            "launchers/run.py ...` starts them together); for one process, unset RANK, WORLD_SIZE and LOCAL_RANK.")


@contextlib.contextmanager
def said_if_waiting(timeout: timedelta, source: str, after_s: float = NOTICE_AFTER_S) -> Iterator[None]:
    """Around the process group's start: ``waiting_notice`` on stderr if it has not returned after ``after_s``
    seconds (a world of one never waits)."""
    world = os.environ.get("WORLD_SIZE", "1").strip()
    if not world.isdigit() or int(world) <= 1:
        yield
        return
    text = waiting_notice(timeout, source, after_s)
    timer = threading.Timer(after_s, lambda: print(text, file=sys.stderr, flush=True))
    timer.daemon = True  # never keeps a process alive
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
