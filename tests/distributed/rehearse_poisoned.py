"""A rehearsal whose warm-up update gets one gradient full of NaN (what a buffer no faked rank filled can hold):
``python tests/distributed/rehearse_poisoned.py <launchers/run.py arguments>``. The first guard check of the run
finds this rank's first gradient tensor filled with NaN; the rehearsal must zero it and step
(tests/test_rehearsal.py)."""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hl_core.engines.base import Engine  # noqa: E402 (after the path insert)

checks = []
unpoisoned = Engine.local_grads_nonfinite


def poisoned(self):
    if not checks:
        self.local_grads()[0].fill_(float("nan"))
    checks.append(1)
    return unpoisoned(self)


Engine.local_grads_nonfinite = poisoned

import launchers.run as launcher  # noqa: E402

sys.exit(launcher.main(sys.argv[1:]))
