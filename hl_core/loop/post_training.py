"""The post-training evaluations' phase of a run (rank 0, engines torn down), and what ``summary.json`` says
about it: ``exit_code: null`` and ``post_training_eval: running`` while it runs (a kill leaves no claim of
success), then its result. SIGTERM/SIGINT during it stop it: ``summary.json`` records the exit code
128 + the signal (143, 130), which the launcher returns; ``final/`` is whole, and ``python -m eval RECIPE.yaml``
runs the evaluations again."""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path
from typing import Callable, Dict

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class EvalInterrupted(BaseException):
    """Raised in the main thread by SIGTERM/SIGINT during the post-training evaluations (a ``BaseException``, so
    an evaluation's ``except Exception`` does not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame):
    raise EvalInterrupted(signum)


def _write(path: Path, summary: Dict) -> None:
    path.write_text(json.dumps(summary, indent=2))


def announce(output_dir: Path, summary: Dict) -> None:
    """Before the trainer lets go of its signal handlers: ``summary.json`` says the run is not over yet."""
    _write(Path(output_dir) / "summary.json", {**summary, "exit_code": None, "post_training_eval": "running"})


def run_post_training(after_training: Callable, recipe, final: Path, summary: Dict, pending_signal: int = 0) -> Dict:
    """``after_training(recipe, final)`` under handlers that turn SIGTERM/SIGINT into a recorded stop;
    ``pending_signal``: one that arrived after training ended (the run stops at once). ``summary``: the
    training's. Returns the run's summary."""
    path = Path(recipe.output_dir) / "summary.json"
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, _raise) for sig in SIGNALS} if main_thread else {}
    try:
        if pending_signal:
            raise EvalInterrupted(pending_signal)
        result = after_training(recipe, final)
        summary = {**summary, "post_training_eval": result}
    except EvalInterrupted as stop:
        code = 128 + stop.signum
        summary = {**summary, "exit_code": code, "post_training_eval": f"interrupted by {stop}"}
        print(f"{stop} received during the post-training evaluations: stopped them (exit code {code}). Training "
              f"finished and `{final}` is whole; run the evaluations again with `python -m eval RECIPE.yaml "
              "--set KEY=VALUE ...` (the run's recipe and overrides).", flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    _write(path, summary)
    return summary
