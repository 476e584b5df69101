"""The trainer's safety side: what ends a run on a non-finite update, and how checkpoints and ``final/`` are
written (complete or invisible, never with non-finite weights, nor untrained ones). ``Trainer`` inherits it; it
uses the trainer's ``engine``, ``recipe``, ``output_dir``, ``is_main``, ``report``, ``skips``, ``updates_done``,
``eval_history``, ``transform``, ``source``, ``reference``, ``callbacks`` (``context()``) and ``start`` (the run
record)."""

from __future__ import annotations

import json
import shutil
from typing import Dict

import torch

from ..storage import checkpoints as ckpt
from ..storage.checkpoints import CHECKPOINT_PREFIX
from .guard import NonFiniteStop, nonfinite_message


class TrainerSafety:
    """Mixed into ``Trainer``: the non-finite decision after each logged update, checkpoint and ``final/`` writes."""

    def _after_nonfinite_check(self, row: Dict) -> None:
        """``train.on_nonfinite``: a skipped update counts toward ``train.max_skipped_updates`` in a row; in
        ``stop`` mode, or at that limit, the run ends here (exit code 3) with nothing saved from it."""
        quantity, detail = self.nonfinite or (None, None)
        at_limit = self.skips.record(quantity is not None)
        if quantity is None or (self.recipe.train.on_nonfinite == "skip" and not at_limit):
            return
        streak = self.skips.in_a_row if self.recipe.train.on_nonfinite == "skip" else 0
        last = ckpt.newest_complete(self.output_dir / "checkpoints")[0]
        self.report.stop_progress()
        self._stop_nonfinite(nonfinite_message(row["step"], quantity, detail, last and str(last), streak))

    def _stop_nonfinite(self, message: str) -> None:
        """End the run with exit code 3: rank 0 closes the sinks and records why in ``summary.json`` (under
        ``torchrun`` the launcher itself exits 1 for any failing worker)."""
        self.report.close()
        if self.is_main:
            summary = {"updates": self.updates_done, "skipped_updates": self.skips.total,
                       "exit_code": NonFiniteStop.exit_code, "stopped": " ".join(message.split())}
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        raise NonFiniteStop(message)

    def _rank0_says(self, flag: bool) -> bool:
        """Rank 0's answer, shared, so no rank skips a (collective) save another rank performs."""
        return self.engine.all_reduce_sum(torch.tensor([float(self.is_main and flag)], dtype=torch.float64)).item() > 0

    def _checkpoint_exists(self, updates_done: int) -> bool:
        path = self.output_dir / "checkpoints" / f"{CHECKPOINT_PREFIX}{updates_done}"
        return self._rank0_says(ckpt.is_complete(path))

    def _refuse_nonfinite_weights(self, what: str) -> None:
        """Every rank checks its own shards; a non-finite value anywhere stops the run (exit code 3)."""
        bad = torch.tensor([float(not self.engine.local_weights_finite())], dtype=torch.float64)
        if self.engine.all_reduce_sum(bad).item() > 0:
            self._stop_nonfinite(
                f"Refused to write {what} at update {self.updates_done}: the policy's weights hold a NaN or inf. "
                "Fix: lower `train.lr`, set `train.max_grad_norm`, or resume from the last complete checkpoint."
            )

    def _save_checkpoint(self) -> None:
        """Every rank writes its files, then rank 0 marks the checkpoint complete (``storage.checkpoints``)."""
        ckpt_dir = self.output_dir / "checkpoints"
        tag = f"{CHECKPOINT_PREFIX}{self.updates_done}"
        self._refuse_nonfinite_weights(f"checkpoint `{tag}`")
        if self.is_main and (ckpt_dir / tag).exists():
            shutil.rmtree(ckpt_dir / tag)  # an incomplete leftover of an interrupted save
        self.engine.barrier()
        state = {"updates_done": self.updates_done, "eval_history": self.eval_history,
                 "skipped": [self.skips.in_a_row, self.skips.total]}
        if hasattr(self.transform, "state_dict"):
            state["transform_state"] = self.transform.state_dict()
        self.engine.save(str(ckpt_dir), tag, state)
        if hasattr(self.source, "state_dict"):
            # per rank: e.g. the sparse-rollout buffer of samples for the coming updates
            torch.save(self.source.state_dict(), ckpt_dir / tag / f"source_rank{self.engine.rank:05d}.pt")
        reference_state = self.reference.state_dict()  # look-ahead syncing: the log-probs kept for this window
        if reference_state is not None:
            torch.save(reference_state, ckpt_dir / tag / ckpt.reference_logps_file(self.engine.rank))
        torch.save(self.engine.rng_state(), ckpt_dir / tag / ckpt.rng_file(self.engine.rank))  # dropout's draws
        self.engine.barrier()
        self.callbacks.on_save(self.context(), ckpt_dir / tag)  # every rank's files are written; not yet complete
        if self.is_main:
            ckpt.mark_complete(ckpt_dir / tag, self.updates_done, self.start.record)
            ckpt.rotate(ckpt_dir, self.recipe.checkpoint.keep_last)
        self.engine.barrier()

    def _restore_rng(self, checkpoint) -> str:
        """This rank's generator states from ``checkpoint``; a notice when it keeps none (an older version)."""
        path = checkpoint / ckpt.rng_file(self.engine.rank)
        if not path.exists():
            return (f"`{checkpoint}` keeps no random generator states (an older version wrote it): with dropout, "
                    "the updates after the resume draw other masks than an uninterrupted run.")
        self.engine.set_rng_state(ckpt.safe_load(path))
        return ""

    def _save_final(self) -> None:
        """``final/``: written whole to ``.final.partial``, then swapped in; never with non-finite weights, nor
        from a run whose every update was skipped (its weights are the untrained ones)."""
        if self.skips.total >= self.updates_done:
            self.report.stop_progress()
            self._stop_nonfinite(
                f"Refused to write `final/`: none of the run's {self.updates_done} updates took an optimizer step "
                f"(all {self.skips.total} were skipped as non-finite under `train.on_nonfinite: skip`), so its "
                "weights are the untrained ones. Fix: lower `train.lr`, set `train.max_grad_norm` (e.g. 1.0), check "
                "the data and `objective.beta`; `train.on_nonfinite=stop` ends such a run at its first bad update."
            )
        self._refuse_nonfinite_weights("`final/`")
        partial = self.output_dir / ckpt.FINAL_PARTIAL
        if self.is_main and partial.exists():
            shutil.rmtree(partial)
        self.engine.barrier()
        self.engine.save_hf(str(partial))
        if self.is_main:
            ckpt.publish_final(self.output_dir)
        self.engine.barrier()
