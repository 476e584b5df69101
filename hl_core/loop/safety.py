"""The run's safety side: what ends a run on a non-finite update, and how checkpoints and ``final/`` are
written (complete or invisible, never with non-finite weights, nor untrained ones). The trainer owns one
``RunSafety``; everything it reads is given to it: the engine, the output directory, the report, the settings
(``SafetySettings``), the parts whose state a checkpoint keeps (``CheckpointParts``), and at each call the run's
``Progress``."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..engines.base import Engine
from ..storage import checkpoints as ckpt
from ..storage.checkpoints import CHECKPOINT_PREFIX
from .guard import NonFiniteStop, SkipCounter, nonfinite_message
from .report import RunReport


@dataclass
class Progress:
    """The run so far, as a checkpoint and a stop record it: updates done, the skip counter, the evaluations."""

    updates_done: int
    skips: SkipCounter
    eval_history: List[Dict[str, float]]


@dataclass(frozen=True)
class SafetySettings:
    """The recipe's settings the safety side acts on.

    Args:
        on_nonfinite: ``train.on_nonfinite`` (``stop`` or ``skip``).
        keep_last: ``checkpoint.keep_last`` (complete checkpoints kept; None: all).
        run_record: this run's record (``loop.run_record``), written into each complete checkpoint.
    """

    on_nonfinite: str
    keep_last: Optional[int]
    run_record: dict


@dataclass(frozen=True)
class CheckpointParts:
    """What a checkpoint keeps beside the engine's files, and who hears that one is written.

    Args:
        transform: the humanline transform; its ``state_dict()`` (the sampling generators; empty for the others)
            is saved per rank (``transform_rank<r>.pt``: each data-parallel rank draws from its own generator).
        source: the data source; its ``state_dict()`` (when it has one: the sparse-rollout buffer) per rank.
        reference: the reference log-probs (``hl_core.reference``); ``state_dict()`` is None or the look-ahead
            window's log-probs, per rank.
        on_save: called with the checkpoint's directory once every rank's files are written, before it is marked
            complete (the callbacks' ``on_save``).
    """

    transform: Any
    source: Any
    reference: Any
    on_save: Callable[[Path], None]


class RunSafety:
    """The non-finite decision after each logged update; checkpoint and ``final/`` writes.

    Args:
        engine: the run's engine (its collectives, files, generator states and weights' finiteness).
        output_dir: the run's directory (``checkpoints/``, ``final/``, ``summary.json``).
        report: the run's output (its progress bar stops and its sinks close before a stop).
        settings: the recipe's settings this acts on.
        parts: what a checkpoint keeps beside the engine's files.
    """

    def __init__(self, engine: Engine, output_dir: Path, report: RunReport, settings: SafetySettings,
                 parts: CheckpointParts):
        self.engine, self.output_dir, self.report = engine, Path(output_dir), report
        self.settings, self.parts = settings, parts
        self.is_main = engine.rank == 0

    def after_update(self, row: Dict, nonfinite: Optional[Tuple[str, object]], progress: Progress) -> None:
        """``train.on_nonfinite`` after the update ``row`` was logged (``nonfinite``: the non-finite quantity and
        its detail, or None): a skipped update counts toward ``train.max_skipped_updates`` in a row; in ``stop``
        mode, or at that limit, the run ends here (exit code 3) with nothing saved from it."""
        quantity, detail = nonfinite or (None, None)
        skip_mode = self.settings.on_nonfinite == "skip"
        at_limit = progress.skips.record(quantity is not None)
        if quantity is None or (skip_mode and not at_limit):
            return
        streak = progress.skips.in_a_row if skip_mode else 0
        last = ckpt.newest_complete(self.output_dir / "checkpoints")[0]
        self.report.stop_progress()
        self.stop_nonfinite(nonfinite_message(row["step"], quantity, detail, last and str(last), streak), progress)

    def stop_nonfinite(self, message: str, progress: Progress) -> None:
        """End the run with exit code 3: rank 0 closes the sinks and records why in ``summary.json`` (under
        ``torchrun`` the launcher itself exits 1 for any failing worker)."""
        self.report.close()
        if self.is_main:
            summary = {"updates": progress.updates_done, "skipped_updates": progress.skips.total,
                       "exit_code": NonFiniteStop.exit_code, "stopped": " ".join(message.split())}
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        raise NonFiniteStop(message)

    def rank0_says(self, flag: bool) -> bool:
        """Rank 0's answer, shared, so no rank skips a (collective) save another rank performs."""
        return self.engine.all_reduce_sum(torch.tensor([float(self.is_main and flag)], dtype=torch.float64)).item() > 0

    def checkpoint_exists(self, updates_done: int) -> bool:
        """Whether the complete checkpoint of ``updates_done`` exists (rank 0's view, shared)."""
        path = self.output_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{updates_done}"
        return self.rank0_says(ckpt.is_complete(path))

    def _refuse_nonfinite_weights(self, what: str, progress: Progress) -> None:
        """Every rank checks its own shards; a non-finite value anywhere stops the run (exit code 3)."""
        bad = torch.tensor([float(not self.engine.local_weights_finite())], dtype=torch.float64)
        if self.engine.all_reduce_sum(bad).item() > 0:
            self.stop_nonfinite(
                f"Refused to write {what} at update {progress.updates_done}: the policy's weights hold a NaN or "
                "inf. Fix: lower `train.lr`, set `train.max_grad_norm`, or resume from the last complete checkpoint.",
                progress,
            )

    def save_checkpoint(self, progress: Progress) -> None:
        """Every rank writes its files, then rank 0 marks the checkpoint complete (``storage.checkpoints``)."""
        ckpt_dir = self.output_dir / "checkpoints"
        tag = f"{CHECKPOINT_PREFIX}{progress.updates_done}"
        self._refuse_nonfinite_weights(f"checkpoint `{tag}`", progress)
        if self.is_main and (ckpt_dir / tag).exists():
            shutil.rmtree(ckpt_dir / tag)  # an incomplete leftover of an interrupted save
        self.engine.barrier()
        state = {"updates_done": progress.updates_done, "eval_history": progress.eval_history,
                 "skipped": [progress.skips.in_a_row, progress.skips.total]}
        parts = self.parts
        self.engine.save(str(ckpt_dir), tag, state)
        transform_state = parts.transform.state_dict()
        if transform_state:  # per rank: the engine's client state is rank 0's alone at ZeRO 0-2 and under Megatron
            torch.save(transform_state, ckpt_dir / tag / ckpt.transform_file(self.engine.rank))
        if hasattr(parts.source, "state_dict"):
            # per rank: e.g. the sparse-rollout buffer of samples for the coming updates
            torch.save(parts.source.state_dict(), ckpt_dir / tag / f"source_rank{self.engine.rank:05d}.pt")
        reference_state = parts.reference.state_dict()  # look-ahead syncing: the log-probs kept for this window
        if reference_state is not None:
            torch.save(reference_state, ckpt_dir / tag / ckpt.reference_logps_file(self.engine.rank))
        torch.save(self.engine.rng_state(), ckpt_dir / tag / ckpt.rng_file(self.engine.rank))  # dropout's draws
        self.engine.barrier()
        parts.on_save(ckpt_dir / tag)  # every rank's files are written; not yet complete
        if self.is_main:
            ckpt.mark_complete(ckpt_dir / tag, progress.updates_done, self.settings.run_record)
            ckpt.rotate(ckpt_dir, self.settings.keep_last)
        self.engine.barrier()

    def restore(self, checkpoint: Path, max_skipped_updates: int, eval_changed: bool) -> Tuple[Progress, List[str]]:
        """What ``save_checkpoint`` wrote, loaded from ``checkpoint`` into the engine and the parts; returns the run's
        progress there (the evaluations dropped when ``eval_changed``: the resumed run evaluates otherwise) and the
        notices to print (a reference or generator state the checkpoint does not keep)."""
        state = self.engine.load(str(checkpoint.parent), checkpoint.name)
        skips = SkipCounter(max_skipped_updates, *state.get("skipped", (0, 0)))
        history = [] if eval_changed else list(state.get("eval_history", []))
        progress = Progress(int(state.get("updates_done", 0)), skips, history)
        parts = self.parts
        transform_state = checkpoint / ckpt.transform_file(self.engine.rank)
        if transform_state.exists():
            parts.transform.load_state_dict(ckpt.safe_load(transform_state))
        elif "transform_state" in state:  # an older version's checkpoint: rank 0's generators, in the client state
            parts.transform.load_state_dict(state["transform_state"])
        source_state = checkpoint / f"source_rank{self.engine.rank:05d}.pt"
        if hasattr(parts.source, "load_state_dict") and source_state.exists():
            parts.source.load_state_dict(ckpt.safe_load(source_state))
        # look-ahead: the window's log-probs (or a new window where they do not cover this run)
        notices = (parts.reference.resume(checkpoint, self.engine.rank, progress.updates_done),
                   self._restore_rng(checkpoint))
        return progress, [notice for notice in notices if notice]

    def _restore_rng(self, checkpoint: Path) -> str:
        """This rank's generator states from ``checkpoint``; a notice when it keeps none (an older version)."""
        path = checkpoint / ckpt.rng_file(self.engine.rank)
        if not path.exists():
            return (f"`{checkpoint}` keeps no random generator states (an older version wrote it): with dropout, "
                    "the updates after the resume draw other masks than an uninterrupted run.")
        self.engine.set_rng_state(ckpt.safe_load(path))
        return ""

    def save_final(self, progress: Progress) -> None:
        """``final/``: written whole to ``.final.partial``, then swapped in; never with non-finite weights, nor
        from a run whose every update was skipped (its weights are the untrained ones)."""
        if progress.skips.total >= progress.updates_done:
            self.report.stop_progress()
            self.stop_nonfinite(
                f"Refused to write `final/`: none of the run's {progress.updates_done} updates took an optimizer "
                f"step (all {progress.skips.total} were skipped as non-finite under `train.on_nonfinite: skip`), so "
                "its weights are the untrained ones. Fix: lower `train.lr`, set `train.max_grad_norm` (e.g. 1.0), "
                "check the data and `objective.beta`; `train.on_nonfinite=stop` ends such a run at its first bad "
                "update.",
                progress,
            )
        self._refuse_nonfinite_weights("`final/`", progress)
        partial = self.output_dir / ckpt.FINAL_PARTIAL
        if self.is_main and partial.exists():
            shutil.rmtree(partial)
        self.engine.barrier()
        self.engine.save_hf(str(partial))
        if self.is_main:
            ckpt.publish_final(self.output_dir)
        self.engine.barrier()
