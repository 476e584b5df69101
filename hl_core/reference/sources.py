"""The reference's log-prob sources the trainer reads: the engine's reference model (``copy``, or ``none``), and
log-probs the policy computed in its place (``cached``, ``lookahead``). The package docstring says when each applies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional

import torch

from ..errors import DataError
from ..humanline import ReferenceSync, SyncRecord, SyncSchedule
from ..storage.checkpoints import reference_logps_file, safe_load
from .store import LogpStore, forward_batches, forward_is_deterministic


def lookahead_state_problem(state) -> Optional[str]:
    """What is wrong with a loaded look-ahead state (``LookaheadReference.state_dict``), or None: a dict with
    ``values`` (batch key -> tensor) and ``policy_is_reference``."""
    if not isinstance(state, dict) or set(state) != {"values", "policy_is_reference"}:
        keys = sorted(state) if isinstance(state, dict) else None
        return f"a {type(state).__name__}" + (f" with keys {keys}" if keys is not None else "") + (
            ", where a dict of `values` and `policy_is_reference` was expected")
    values = state["values"]
    if not isinstance(values, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in values.items()):
        return f"`values` is a {type(values).__name__} that does not map batch keys to tensors"
    return None


class ReferenceLogps:
    """The engine's reference model (``copy``), or none (``none``); the base of the copy-free modes.

    ``logps(batch, temperature, policy_logps)`` serves the trainer, ``token_logps(batch, model)`` the objectives'
    extra forwards (KTO's KL rows), and ``before_optimizer_step(updates_done)``, which the trainer calls between an
    update's last backward and its optimizer step, keeps it current: humanline's ``ReferenceSync`` over the engine's
    ``reference_pairs()`` when ``schedule`` syncs, else nothing."""

    def __init__(self, engine, mode: str, reason: str, schedule: Optional[SyncSchedule] = None):
        self.engine, self.mode, self.reason = engine, mode, reason
        self.sync: Optional[ReferenceSync] = None
        if schedule is not None and schedule.every is not None:
            self.sync = ReferenceSync(engine.reference_pairs(), schedule)

    def before_optimizer_step(self, updates_done: int) -> SyncRecord:
        """The reference's part of update ``updates_done``, after its last backward and before its step."""
        return self.sync.before_optimizer_step(updates_done) if self.sync is not None else SyncRecord(False)

    @property
    def available(self) -> bool:
        return self.engine.has_reference

    def logps(self, batch, temperature: float = 1.0, policy_logps: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.engine.token_logps(batch, "reference", temperature)

    def token_logps(self, batch, model: str = "policy", temperature: float = 1.0) -> torch.Tensor:
        if model == "reference":
            return self.logps(batch, temperature)
        return self.engine.token_logps(batch, model, temperature)

    def state_dict(self) -> Optional[dict]:
        return None  # nothing beyond the engine's own checkpoint

    def load_state_dict(self, state: dict) -> None:
        pass

    def resume(self, checkpoint, rank: int, updates_done: int) -> Optional[str]:
        """After the engine loaded ``checkpoint`` (``updates_done`` updates): restore what this mode keeps; a notice
        when the checkpoint was written in another mode (e.g. ``train.on_nonfinite: skip`` chose a copy after a
        look-ahead run stopped)."""
        if self.engine.resynced_at_resume:
            return ("The checkpoint was written with look-ahead syncing and keeps no reference copy; this run keeps "
                    f"one ({self.reason}). It starts from the policy's weights at the resume: one extra sync there.")
        return None


class StoredReferenceLogps(ReferenceLogps):
    """Log-probs the policy computed in place of a reference model, looked up by batch."""

    def __init__(self, engine, mode: str, reason: str, store: Optional[LogpStore] = None):
        super().__init__(engine, mode, reason)
        self.store = store or LogpStore()
        self.policy_is_reference = False  # before the first optimizer step (look-ahead): read the policy itself
        self.detach_is_exact = forward_is_deterministic(engine.trained_module())

    @property
    def available(self) -> bool:
        return True

    def logps(self, batch, temperature: float = 1.0, policy_logps: Optional[torch.Tensor] = None) -> torch.Tensor:
        stored = self.store.get(batch, temperature)
        if stored is not None:
            return stored.to(self.engine.device)
        if self.policy_is_reference:
            if policy_logps is not None and self.detach_is_exact:
                return policy_logps.detach()  # the reference's weights are the policy's: no extra forward
            with self.engine.policy_as_reference():
                return self.engine.token_logps(batch, "policy", temperature)
        raise RuntimeError(
            f"No reference log-probs were kept for this batch (reference mode `{self.mode}`): the batches this "
            "run trains or evaluates on differ from the ones computed ahead. This is a bug in hl_core; as a "
            "workaround set `humanline.reference=copy` (or `train.cache_reference_logps=false`)."
        )


class LookaheadReference(StoredReferenceLogps):
    """Look-ahead syncing: at each window start (``before_optimizer_step``) it replaces the stored log-probs
    with the policy's for the batches up to the next sync (see the module docstring). A window is computed whole
    even where it reaches past ``max_steps`` (with the eval set), so a finished run extended to more updates
    continues exactly; a resume whose window the checkpoint does not cover starts a new window there."""

    def __init__(self, engine, reason: str, humanline, max_steps: int, batches_of_update: Callable[[int], List[dict]],
                 eval_batches: Optional[Callable[[], Iterable[dict]]], eval_at: Callable[[int], bool]):
        super().__init__(engine, "lookahead", reason)
        self.schedule, self.max_steps = SyncSchedule(humanline.sync_every, humanline.sync_offset), max_steps
        self.batches_of_update, self.eval_batches, self.eval_at = batches_of_update, eval_batches, eval_at
        self.policy_is_reference = True  # until update 0's optimizer step (a resume loads its state instead)

    def window_end(self, start: int) -> int:
        """The next sync after ``start``: the last update whose forward reads ``start``'s weights."""
        n = start + 1
        while not self.schedule.due(n):
            n += 1
        return n

    def window_start(self, updates_done: int) -> int:
        """The window start (update 0 or a sync) whose weights update ``updates_done`` reads as its reference."""
        n = updates_done - 1
        while n > 0 and not self.schedule.due(n):
            n -= 1
        return max(n, 0)

    def _evals_in(self, first: int, last: int) -> bool:
        return (self.eval_batches is not None
                and any(self.eval_at(u) for u in range(first, min(last, self.max_steps) + 1)))

    def before_optimizer_step(self, updates_done: int) -> SyncRecord:
        engine = self.engine
        synced = self.schedule.due(updates_done)
        if not (synced or updates_done == 0 or self.policy_is_reference):  # a window starts at 0 or a resume
            return SyncRecord(False, 0.0)
        engine.synchronize()
        start = time.perf_counter()
        end = self.window_end(updates_done)
        self.store = LogpStore()
        self.store.fill(engine, (b for m in range(updates_done + 1, end + 1) for b in self.batches_of_update(m)), 1.0)
        # the eval set when an evaluation falls in the window, or the window reaches past the run's end (a run
        # extended to more updates may evaluate there)
        if self._evals_in(updates_done + 1, end) or (end > self.max_steps and self.eval_batches is not None):
            self.store.fill(engine, self.eval_batches(), 1.0)
        self.policy_is_reference = False
        engine.synchronize()
        return SyncRecord(synced, time.perf_counter() - start)

    def state_dict(self) -> dict:
        return {"values": self.store.values, "policy_is_reference": torch.tensor(self.policy_is_reference)}

    def load_state_dict(self, state: dict) -> None:
        self.store = LogpStore(state["values"])
        self.policy_is_reference = bool(state["policy_is_reference"])

    def _covers(self, updates_done: int) -> bool:
        """The stored log-probs hold every batch this run reads before its next window starts (on this rank)."""
        if self.policy_is_reference:
            return True
        end = self.window_end(self.window_start(updates_done))
        batches = [b for m in range(updates_done, min(end, self.max_steps - 1) + 1) for b in self.batches_of_update(m)]
        if self._evals_in(updates_done + 1, end):
            batches += list(self.eval_batches())
        return all(self.store.get(f, 1.0) is not None for b in batches for f in forward_batches(b))

    def resume(self, checkpoint, rank: int, updates_done: int) -> Optional[str]:
        path = Path(checkpoint) / reference_logps_file(rank)
        if not path.exists():
            self.store, self.policy_is_reference = LogpStore(), True  # a new window starts at the resume
            return ("The checkpoint keeps a reference copy, not look-ahead log-probs; this run syncs by look-ahead: "
                    "its reference starts from the policy's weights at the resume (one extra sync there).")
        state = safe_load(path)
        problem = lookahead_state_problem(state)
        if problem:
            raise DataError(
                f"`{path}` does not hold look-ahead log-probs ({problem}): it was damaged or written by something "
                f"else. "
                "Nothing was loaded. Fix: delete that file (the reference then restarts from the policy's weights at "
                "the resume, one extra sync), or resume from another checkpoint (`checkpoint.resume=step_N`)."
            )
        self.load_state_dict(state)
        missing = torch.tensor([float(not self._covers(updates_done))], dtype=torch.float64)
        if self.engine.all_reduce_sum(missing).item() == 0:
            return None
        self.store, self.policy_is_reference = LogpStore(), True  # every rank starts a new window at the resume
        return (f"The checkpoint's look-ahead log-probs do not cover what this run reads from update {updates_done} "
                "(its data, batch layout or evaluations changed): the reference restarts from the policy's weights "
                "at the resume (one extra sync there).")
