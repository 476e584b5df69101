"""What stops a run early, and with which exit code: non-finite updates and SIGTERM/SIGINT.

Exit codes of ``launchers/run.py`` (docs/reference/exit-codes.md lists them too):

    0 finished (or stopped cleanly by a STOP file or ``train.stop_after``), 1 failure (a bug, a crash),
    2 bad input, 3 stopped on a non-finite update (or every update skipped: no ``final/``), 4 stopped by
    SIGTERM/SIGINT after saving a resumable checkpoint; a second signal exits at once with 128 + the signal
    (143 for SIGTERM, 130 for SIGINT), and so does a signal during the post-training evaluations
    (``hl_core/loop/post_training.py``: training finished, ``summary.json`` records it), 5 the disk filled while
    a checkpoint, ``final/`` or the reference cache was written (one paragraph: the file, the last complete
    checkpoint, "free space and rerun"; ``hl_core/storage/disk_full.py``).

Per update every rank checks its own view (the loss and the objective's statistics of its micro-batches,
its own gradient shards) and the flags travel in the update's totals reduction, together with the STOP
file and a pending signal, so all ranks decide alike without another collective (``GuardFlags``). The checks
stay on the device until that reduction (``UpdateChecks``): which metric went non-finite is read only on the
rare path where one did.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch

EXIT_OK, EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_INTERRUPTED = 0, 1, 2, 3, 4
EXIT_DISK_FULL = 5  # no space left on device while writing (hl_core.errors.DiskFull)
DUPLICATE_SIGNAL_S = 1.0  # launchers forward the signal the process group already got: one request, not two


class NonFiniteStop(Exception):
    """The run stopped on a non-finite update (exit code 3); the message is one paragraph."""

    exit_code = EXIT_NONFINITE

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


def first_nonfinite(values: Dict[str, object]) -> Optional[str]:
    """The first key (sorted) whose value is a non-finite number (a float or a 0-dim tensor, read on the host),
    else None."""
    for key in sorted(values):
        value = values[key]
        if isinstance(value, torch.Tensor):
            value = float(value)
        if isinstance(value, float) and not math.isfinite(value):
            return key
    return None


class UpdateChecks:
    """This rank's non-finite checks of one update's micro-batches, as device values: ``add`` per micro-batch (no
    host read), ``vector`` the guard's numbers for the update's one reduction, ``detail`` (host reads: only on the
    non-finite path) which quantity it was."""

    def __init__(self):
        self.loss: object = 0.0  # count of micro-batches whose loss is not finite
        self.statistics: object = 0.0  # count of non-finite metric values
        self._seen: List[tuple] = []  # (loss, metrics) of each micro-batch, detached: for ``detail``

    @torch.no_grad()
    def add(self, loss: torch.Tensor, metrics: Dict[str, object]) -> None:
        loss = loss.detach()
        self._seen.append((loss, metrics))
        self.loss = self.loss + (~torch.isfinite(loss)).to(torch.float64)
        values = [v.detach().to(device=loss.device, dtype=torch.float64).reshape(())
                  for v in metrics.values() if isinstance(v, torch.Tensor)]
        floats = [v for v in metrics.values() if isinstance(v, float) and not math.isfinite(v)]
        if values:
            self.statistics = self.statistics + (~torch.isfinite(torch.stack(values))).to(torch.float64).sum()
        self.statistics = self.statistics + float(len(floats))

    def vector(self, tokens: float, stop_file: float, signal_requested: float, grads_nonfinite,
               device) -> torch.Tensor:
        """``[tokens, *GuardFlags.NAMES]`` as one float64 vector on ``device`` (host numbers in one copy)."""
        host = torch.tensor([float(tokens), float(stop_file), float(signal_requested)], dtype=torch.float64)
        checks = [torch.as_tensor(v, dtype=torch.float64).to(device).reshape(())
                  for v in (self.loss, grads_nonfinite, self.statistics)]
        return torch.cat([host.to(device), torch.stack(checks)])

    def detail(self) -> Optional[str]:
        """``loss`` when one of this rank's losses is not finite, else the first non-finite metric of the first
        micro-batch that has one (None: another rank's). Reads the values on the host."""
        if any(not math.isfinite(float(loss)) for loss, _ in self._seen):
            return "loss"
        for _, metrics in self._seen:
            key = first_nonfinite(metrics)
            if key is not None:
                return key
        return None


@dataclass
class GuardFlags:
    """One update's view of this rank, as the numbers appended to its totals reduction; after the
    reduction the same class reads the sums (any rank's flag counts)."""

    stop_file: float = 0.0
    signal: float = 0.0
    loss: float = 0.0
    grads: float = 0.0
    statistics: float = 0.0
    NAMES = ("stop_file", "signal", "loss", "grads", "statistics")

    def values(self) -> List[float]:
        return [float(getattr(self, name)) for name in self.NAMES]

    @classmethod
    def from_sums(cls, sums: Iterable[float]) -> "GuardFlags":
        return cls(*(float(v > 0) for v in sums))

    def nonfinite(self) -> Optional[str]:
        """Which quantity went non-finite on some rank (the first of loss, gradients, statistics), or None."""
        for name in ("loss", "grads", "statistics"):
            if getattr(self, name):
                return name
        return None


_WHAT = {
    "loss": "the loss",
    "grads": "a gradient (the gradient norm of some rank's shard is NaN or inf)",
    "statistics": "a log-ratio statistic of the objective",
}


def nonfinite_message(update: int, quantity: str, detail: Optional[str], last_checkpoint: Optional[str],
                      skipped_in_a_row: int = 0) -> str:
    """The one paragraph printed when a run stops on a non-finite update."""
    what = _WHAT[quantity] + (f" (`{detail}` on rank 0)" if detail else "")
    streak = (f" after {skipped_in_a_row} skipped updates in a row (`train.max_skipped_updates`)"
              if skipped_in_a_row else "")
    kept = (f"The last good checkpoint, `{last_checkpoint}`, is kept and resumable" if last_checkpoint
            else "No checkpoint was saved before it")
    return (
        f"Stopped at update {update} (`step` {update} in metrics.jsonl){streak}: {what} is not finite. Nothing "
        f"from that update was saved and no `final/` was written. {kept}. Fix: lower `train.lr`, set "
        "`train.max_grad_norm` (e.g. 1.0), check the data and `objective.beta`; under bf16, a run with "
        "`engine.precision=fp32` tells rounding from real divergence. `train.on_nonfinite=skip` drops such updates "
        "instead of stopping."
    )


class SkipCounter:
    """``train.on_nonfinite: skip``: counts skipped updates, in total and in a row."""

    def __init__(self, limit: int, in_a_row: int = 0, total: int = 0):
        self.limit, self.in_a_row, self.total = limit, in_a_row, total

    def record(self, skipped: bool) -> bool:
        """Record one update; True when the run must stop (``limit`` skipped in a row)."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        self.total += int(skipped)
        return self.in_a_row >= self.limit


@dataclass
class StopSignals:
    """SIGTERM/SIGINT: the first asks for a checkpoint and a clean stop at the next update boundary
    (``requested``); a second one (a copy forwarded by the launcher within ``DUPLICATE_SIGNAL_S`` does not
    count) exits at once with 128 + the signal. SIGUSR1 keeps its SLURM meaning (the job's shell writes STOP)."""

    received: Optional[int] = None
    at: float = 0.0
    _previous: Dict[int, object] = field(default_factory=dict)

    def install(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def hand_over(self, handler) -> Dict[int, object]:
        """Put ``handler`` in place of this object's handlers with no moment of the defaults in between (a signal
        then would end the process unrecorded); returns the handlers from before ``install``, which the new
        owner puts back. ``uninstall`` then does nothing."""
        previous = dict(self._previous)
        for sig in previous:
            signal.signal(sig, handler)
        self._previous.clear()
        return previous

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received is None:
            self.received, self.at = signum, now
            name = signal.Signals(signum).name
            if os.environ.get("RANK", "0") == "0":
                print(f"{name} received: checkpointing at the next update boundary, then exiting with code "
                      f"{EXIT_INTERRUPTED} (send it again to exit at once).", flush=True)
        elif now - self.at > DUPLICATE_SIGNAL_S:
            print(f"{signal.Signals(signum).name} again: exiting at once.", flush=True)
            os._exit(128 + signum)

    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""
