"""The post-training evaluations' phase of a run (rank 0, engines torn down), and what ``summary.json`` says
about it: ``exit_code: null`` and ``post_training_eval: running`` while it runs (a kill leaves no claim of
success), then its result. SIGTERM/SIGINT during it stop it: ``summary.json`` records the exit code
128 + the signal (143, 130), which the launcher returns; ``final/`` is whole, and ``python -m eval RECIPE.yaml``
runs the evaluations again.

The evaluations run in a child process (``hl_core/children.py``; ``hl_core/loop/eval_child.py`` imports and calls
the function), and this process's handlers only record a signal and stop the child's process group (SIGTERM): a
handler that raised could land inside a finalizer (``DeepSpeedEngine.__del__``), where Python prints
"Exception ignored in" and drops the exception, and the evaluations would run to the end. The child's output is
relayed line by line to this process's ``sys.stdout`` / ``sys.stderr``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Dict, Optional, TextIO

import torch

from .. import children
from .guard import StopSignals

SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.5  # how often the wait for the child looks whether a signal came and the child outlived it


class SignalRecord:
    """SIGTERM/SIGINT handler of the post-training phase: records the first signal and, for every one, sends
    SIGTERM to the child's process group (``child``, once started; SIGTERM whichever came: a SIGINT there would be
    a ``KeyboardInterrupt``, which a finalizer in the child could drop too). It never raises, so a signal that
    lands inside a finalizer still counts."""

    def __init__(self, pending: Optional[int] = None):
        self.signum: Optional[int] = pending or None
        self.child: Optional[int] = None
        self._previous: Dict[int, object] = {}

    def __call__(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
        child = self.child
        if child is not None:
            try:
                os.killpg(child, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass

    def install(self, previous: Optional[Dict[int, object]] = None) -> "SignalRecord":
        """Take SIGTERM/SIGINT (main thread only); ``previous``: the handlers to put back on ``restore``, when the
        ones being replaced are someone else's temporary ones (``StopSignals.hand_over``)."""
        if threading.current_thread() is threading.main_thread():
            replaced = {sig: signal.signal(sig, self) for sig in SIGNALS}
            self._previous = dict(previous) if previous is not None else replaced
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""


def _write(path: Path, summary: Dict) -> None:
    path.write_text(json.dumps(summary, indent=2))


def announce(output_dir: Path, summary: Dict, stop_signals: Optional[StopSignals] = None) -> SignalRecord:
    """The post-training phase begins, before the trainer lets go of its signal handlers: ``summary.json`` says the
    run is not over yet, and SIGTERM/SIGINT go to the returned ``SignalRecord`` from here, taken over from the
    trainer's ``stop_signals`` with no moment of the defaults in between (a signal then would end the process
    unrecorded); it holds the signal they received, if one came."""
    _write(Path(output_dir) / "summary.json", {**summary, "exit_code": None, "post_training_eval": "running"})
    if stop_signals is None:
        return SignalRecord().install()
    record = SignalRecord(stop_signals.received)
    return record.install(previous=stop_signals.hand_over(record))


def target_of(fn: Callable) -> str:
    """The reference by which the child imports ``fn``: ``module:qualname``, or ``/path/to/file.py:qualname`` for
    a function of a script run as ``__main__``. Raises ``ValueError`` for a lambda or a nested function."""
    name = fn.__qualname__
    if "<" in name:
        raise ValueError(f"the post-training function `{name}` must be a module-level function (its child imports it)")
    module = fn.__module__
    if module == "__main__":
        main = sys.modules["__main__"]
        module = main.__spec__.name if main.__spec__ is not None else str(Path(main.__file__).resolve())
    return f"{module}:{name}"


def _child_env(fn: Callable) -> Dict[str, str]:
    """This process's environment, with the directory that holds ``fn``'s top package first on ``PYTHONPATH``."""
    env = dict(os.environ)
    module = sys.modules.get(fn.__module__)
    source = module.__file__ if module is not None and fn.__module__ != "__main__" else None
    if source:
        root = Path(source).resolve().parent
        for _ in range(fn.__module__.count(".") + (Path(source).name == "__init__.py")):
            root = root.parent
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH", "")) if p)
    return env


def _relay(stream, sink: Callable[[], TextIO], name: str) -> threading.Thread:
    """Copy ``stream``'s lines to ``sink()`` (asked per line: a test may redirect ``sys.stdout``) in a thread."""

    def copy() -> None:
        for line in iter(stream.readline, ""):
            out = sink()
            out.write(line)
            out.flush()
        stream.close()

    thread = threading.Thread(target=copy, name=f"hl-post-training-{name}", daemon=True)
    thread.start()
    return thread


def release_device_memory() -> None:
    """The trained engines' memory back to the device before the child allocates its own (torch's caching
    allocator would keep the freed blocks for this process). A finalizer run here may meet a signal: recorded."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run_in_child(fn: Callable, argument: Dict, final: Path, record: SignalRecord, workdir: Path) -> Optional[int]:
    """``fn(<argument>, final)`` in a child process; returns its exit code, or None when ``record`` holds a signal
    before it started. ``argument``: JSON-serialisable, carried unread to the child, which rebuilds ``fn``'s first
    argument from it (``hl_core/loop/eval_child.py``). A signal while it runs goes to the child's group
    (``record``); the child's group is ended ``children.GRACE_S`` after it if still there. The result lands in
    ``workdir/result.json``."""
    (workdir / "argument.json").write_text(json.dumps(argument))
    cmd = [sys.executable, "-m", "hl_core.loop.eval_child", target_of(fn), str(workdir / "argument.json"), str(final),
           str(workdir / "result.json")]
    release_device_memory()
    if record.signum is not None:
        return None
    proc = children.popen(cmd, env=_child_env(fn), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          stdin=subprocess.DEVNULL)
    relays = [_relay(proc.stdout, lambda: sys.stdout, "stdout"), _relay(proc.stderr, lambda: sys.stderr, "stderr")]
    try:
        record.child = proc.pid
        if record.signum is not None:  # it came between the look above and this line
            record(record.signum, None)
        while proc.poll() is None:
            try:
                proc.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                if record.signum is not None:
                    children.end(proc)
    finally:
        record.child = None
        code = children.end(proc)
        for relay in relays:
            relay.join(timeout=children.GRACE_S)
    return code


def _interrupted(summary: Dict, record: SignalRecord, final: Path) -> Dict:
    code = 128 + record.signum
    print(f"{record.name()} received during the post-training evaluations: stopped them (exit code {code}). Training "
          f"finished and `{final}` is whole; run the evaluations again with `python -m eval RECIPE.yaml "
          "--set KEY=VALUE ...` (the run's recipe and overrides).", flush=True)
    return {**summary, "exit_code": code, "post_training_eval": f"interrupted by {record.name()}"}


def run_post_training(after_training: Callable, argument: Dict, output_dir: Path, final: Path, summary: Dict,
                      pending_signal: int = 0, record: Optional[SignalRecord] = None) -> Dict:
    """``after_training(<argument>, final)`` (a module-level function) in a child process (``run_in_child``: the
    trainer's ``argument`` is its recipe as JSON, ``config.recipe_to_json``, which the child validates again),
    SIGTERM/SIGINT recorded and passed on to it (``record``: one already installed, which may hold a signal; else
    one is installed here with ``pending_signal``, one that arrived after training ended). A recorded signal stops
    the run with 128 + the signal, whenever it came. ``summary``: the training's, written to
    ``output_dir/summary.json`` with the phase's outcome. Returns the run's summary."""
    if record is None:
        record = SignalRecord(pending_signal).install()
    path = Path(output_dir) / "summary.json"
    workdir = Path(tempfile.mkdtemp(prefix="hl-post-training-"))
    try:
        code = run_in_child(after_training, argument, final, record, workdir)
        if record.signum is not None:
            summary = _interrupted(summary, record, final)
        elif code == 0 and (workdir / "result.json").is_file():
            summary = {**summary, "post_training_eval": json.loads((workdir / "result.json").read_text())}
        else:
            print(f"the post-training evaluations' process failed (exit code {code}; its output is above). "
                  f"Training finished and `{final}` is whole; run them again with `python -m eval RECIPE.yaml`.",
                  file=sys.stderr, flush=True)
            summary = {**summary, "exit_code": 1, "post_training_eval": f"failed (its process exited with {code})"}
    finally:
        record.restore()
        shutil.rmtree(workdir, ignore_errors=True)
    _write(path, summary)
    return summary
