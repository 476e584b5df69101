"""One run per output directory: ``<output_dir>/.lock``, held by rank 0 from setup to the end of the run.

The lock file holds its holder: pid, host, the process's start time (so a reused pid does not look alive) and
the SLURM job id when there is one. Taking it:

* no lock: created with ``O_EXCL`` (two runs starting at once: one wins);
* a lock of this process's own SLURM job (a requeued job starts again, often on another node): taken over;
* a lock on this host whose process is gone (killed, crashed): taken over, with one line saying so;
* otherwise (a live run here, or a run on another host): refused in one paragraph naming the holder (exit 2).
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ..errors import RecipeError

LOCK_FILE = ".lock"


def _start_time(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat``), or None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def _alive(pid: int, started: Optional[str]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    now = _start_time(pid)
    return started is None or now is None or now == started


def _holder() -> dict:
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid()),
              "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    if os.environ.get("SLURM_JOB_ID"):
        holder["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
    return holder


def _describe(holder: dict) -> str:
    job = f", SLURM job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on host {holder.get('host')}{job}, since {holder.get('since')}"


class OutputDirLock:
    """``acquire()`` on rank 0 before the run writes anything; ``release()`` at its end. ``notice``: the line
    printed when a stale lock was taken over (or '')."""

    def __init__(self, output_dir):
        self.path = Path(output_dir) / LOCK_FILE
        self.holder = _holder()
        self.held, self.notice = False, ""

    def acquire(self) -> "OutputDirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):  # a lock released or taken over between our looks: look again
            if self._create():
                self.held = True
                return self
            text, other = self._read()
            if other is None and text is None:
                continue  # gone meanwhile
            if not self._stale(other):
                raise RecipeError(
                    f"`output_dir: {self.path.parent}` is in use by another run ({_describe(other)}; lock file "
                    f"`{self.path}`): two runs in one directory delete each other's checkpoints and mix their "
                    "metrics. Fix: wait for that run to end, or give this one another `output_dir`; if that run is "
                    f"gone (its host rebooted, say), delete `{self.path}`."
                )
            if self._take_over(text):
                self.held = True
                why = ("this SLURM job was requeued" if other.get("slurm_job_id") == self.holder.get("slurm_job_id")
                       else "that process is gone")
                self.notice = f"Took over the stale lock on {self.path.parent} ({_describe(other)}: {why})."
                return self
        raise RecipeError(f"Could not take the lock `{self.path}`: other runs keep taking it. Fix: start one run per "
                          "`output_dir`.")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(self.holder))
        return True

    def _read(self):
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        return text, holder if isinstance(holder, dict) else {"pid": "?", "host": "?", "since": "? (unreadable lock)"}

    def _stale(self, other: dict) -> bool:
        job = self.holder.get("slurm_job_id")
        if job and other.get("slurm_job_id") == job:
            return True  # the same SLURM job: a requeued run of it (ranks other than 0 never take the lock)
        if other.get("host") != self.holder["host"] or not isinstance(other.get("pid"), int):
            return False  # another host's process cannot be checked from here
        return not _alive(other["pid"], other.get("started"))

    def _take_over(self, stale_text: str) -> bool:
        """Move the stale lock aside, and make sure it was that one (not a lock another run took meanwhile)."""
        aside = self.path.with_name(f"{LOCK_FILE}.stale.{os.getpid()}")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return False
        if aside.read_text() != stale_text:
            os.replace(aside, self.path)  # someone else's fresh lock: put it back
            return False
        aside.unlink()
        return self._create()

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        _, holder = self._read()
        if holder is not None and holder.get("pid") == self.holder["pid"] and holder.get("host") == self.holder["host"]:
            self.path.unlink(missing_ok=True)
