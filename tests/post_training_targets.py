"""Post-training functions for the signal tests (``hl_core/loop/post_training.py`` calls them in its child
process, importing this module by name), and ``python tests/post_training_targets.py OUT MODE``: a run's
post-training phase alone, on the tiny recipe, ending with its summary's exit code.

``finalizers_in_a_loop`` spends nearly all its time inside ``__del__`` of objects freed by the cyclic garbage
collector, as a ``DeepSpeedEngine`` is: a signal to the run lands inside a finalizer. With ``MODE`` ``self``
the first finalizer sends the run SIGTERM itself (a signal inside a finalizer every time); with ``external``
the test sends it once ``OUT/evaluating`` exists.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from pathlib import Path

RUN_PID_ENV = "HL_TEST_RUN_PID"  # the process that runs the post-training phase (the child's parent)
FROM_FINALIZER_ENV = "HL_TEST_SIGNAL_FROM_FINALIZER"
FINALIZER_S = 0.05  # each finalizer's busy time
ROUNDS = 200  # 10 s of finalizers: far longer than a signal takes to stop them


class SlowFinalizer:
    """A reference cycle (freed only by the cyclic collector) whose ``__del__`` busy-waits ``FINALIZER_S``, and
    first sends SIGTERM to the run when ``signal_run``."""

    def __init__(self, signal_run: bool):
        self.cycle = self
        self.signal_run = signal_run

    def __del__(self):
        if self.signal_run:
            os.kill(int(os.environ[RUN_PID_ENV]), signal.SIGTERM)
        deadline = time.monotonic() + FINALIZER_S
        while time.monotonic() < deadline:
            pass


def finalizers_in_a_loop(recipe, final: Path):
    """``ROUNDS`` slow finalizers, each run by a forced collection; ``output_dir/evaluating`` (this process's id)
    written first."""
    from_finalizer = os.environ.get(FROM_FINALIZER_ENV) == "1"
    (Path(recipe.output_dir) / "evaluating").write_text(str(os.getpid()))
    for i in range(ROUNDS):
        SlowFinalizer(signal_run=from_finalizer and i == 0)
        gc.collect(0)  # the youngest generation, where the new cycle is: quick beside the finalizer
    return {"finalizers": ROUNDS}


def says_hello(recipe, final: Path):
    """Prints a line on each stream and returns what it was called with."""
    print(f"hello from {os.getpid()}", flush=True)
    print("and on stderr", file=sys.stderr, flush=True)
    return {"name": recipe.name, "final": str(final)}


def fails(recipe, final: Path):
    raise RuntimeError("an evaluation's bug")


def main(out: str, mode: str) -> int:
    """The post-training phase of a finished run in ``out`` (a ``final/`` directory, ``summary.json``)."""
    from hl_core.config import load_recipe, recipe_to_json
    from hl_core.loop.post_training import announce, run_post_training

    os.environ[RUN_PID_ENV] = str(os.getpid())
    os.environ[FROM_FINALIZER_ENV] = "1" if mode == "self" else "0"
    tiny = Path(__file__).resolve().parent.parent / "recipes" / "tiny" / "humanline_dpo.yaml"
    recipe = load_recipe(tiny, [f"output_dir={out}"])
    final = Path(out) / "final"
    final.mkdir(parents=True, exist_ok=True)
    summary = {"updates": 3, "exit_code": 0}
    announce(out, summary)
    from post_training_targets import finalizers_in_a_loop as target  # by its module's name, as a child imports it

    return run_post_training(target, recipe_to_json(recipe), out, final, summary).get("exit_code", 0)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
