"""What a run shows and leaves behind, on rank 0: the progress bar, printed lines, metric rows (the sinks),
and the end-of-run summary (printed, and ``summary.json``). On the other ranks every method does nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .. import __version__
from ..storage.checkpoints import CHECKPOINT_PREFIX, FINAL_DIR
from .sinks import Sinks

REPO_ROOT = Path(__file__).resolve().parents[2]


def provenance() -> Dict[str, Optional[str]]:
    """The package version, and the git commit of the checkout it runs from (None for an installed copy)."""
    commit = None
    if (REPO_ROOT / ".git").exists():
        try:  # fixed arguments: nothing from the recipe reaches the command
            done = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10)
            commit = done.stdout.strip() if done.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"version": __version__, "git_commit": commit}


def shows_bar(progress_bar: Optional[bool]) -> bool:
    """``logging.progress_bar``: true forces tqdm bars, false turns them off; null (the default) shows them only
    when stderr is a terminal, so a log file gets plain lines rather than repaints."""
    return sys.stderr.isatty() if progress_bar is None else progress_bar


def configure_bars(progress_bar: Optional[bool], rank0: bool) -> bool:
    """At the start of a run: whether this process shows progress bars (rank 0, when ``shows_bar`` says so).
    Without, the libraries' bars are off too (model writes, hub downloads, dataset loading)."""
    bars = rank0 and shows_bar(progress_bar)
    if not bars:
        from huggingface_hub.utils import disable_progress_bars  # imported here: only the bar switch, when off
        from transformers.utils import logging as transformers_logging  # imported here: likewise (seconds to load)

        transformers_logging.disable_progress_bar()
        disable_progress_bars()
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"  # read when `datasets` is first imported
    return bars

# held-out metrics the end-of-run summary prints (start -> end), when the objective reports them
SUMMARY_EVAL_KEYS = {
    "policy/accuracy": "preference accuracy (policy log-prob of chosen > rejected)",
    "policy/margin": "per-token log-prob margin, preferred minus dispreferred",
    "policy/adv_logp": "advantage-weighted per-token log-prob",
    "reward": "mean reward of one sampled completion per prompt",
    "win_rate_vs_start": "win rate of that completion against the first evaluation's, under the reward",
    "rewards/accuracy": "reward accuracy against the current reference",
    "loss": "loss against the current reference",
}
EVAL_SHOWN = ("loss", "rewards/accuracy", "policy/accuracy", "reward", "win_rate_vs_start")
SKIPPED_WARN_FRACTION = 0.25  # more skipped updates than this share of the run's: the summary warns


def skipped_words(updates: int, skipped: int) -> str:
    """The summary's headline words for ``updates`` updates of which ``skipped`` were skipped as non-finite."""
    if not skipped:
        return f"{updates} updates"
    return f"{updates} updates ({skipped} skipped as non-finite, {max(updates - skipped, 0)} optimizer steps)"


def skipped_warning(updates: int, skipped: int) -> Optional[str]:
    """One line when more than a quarter of the run's updates were skipped (``train.on_nonfinite: skip``), else None."""
    if updates <= 0 or skipped <= SKIPPED_WARN_FRACTION * updates:
        return None
    return (f"warning: {skipped} of {updates} updates ({100 * skipped / updates:.0f}%) were skipped as non-finite "
            "(`train.on_nonfinite: skip`): the weights took only the other updates' steps. Fix: lower `train.lr`, set "
            "`train.max_grad_norm`, check the data; under bf16 compare with `engine.precision=fp32`.")


@dataclass
class StepTimes:
    """Per-update wall-clock seconds of this run (not of updates before a resume)."""

    step: List[float] = field(default_factory=list)
    sync: List[float] = field(default_factory=list)
    rollout: List[float] = field(default_factory=list)

    def add(self, row: Dict) -> None:
        self.step.append(row["step_time_s"])
        self.sync.append(row["sync_time_s"])
        self.rollout.append(row.get("rollout_time_s", 0.0))


class RunReport:
    """Rank 0's output. ``logging_cfg`` is the recipe's ``logging`` section."""

    def __init__(self, is_main: bool, output_dir: Path, logging_cfg, run_name: str, bars: bool = False):
        self.is_main, self.output_dir, self.cfg, self.run_name = is_main, Path(output_dir), logging_cfg, run_name
        self.bars = is_main and bars  # tqdm bars (``configure_bars``); else a plain line every `log_every` updates
        self.sinks: Optional[Sinks] = None
        self.bar = None

    def open(self, updates_done: int, run_config: Dict) -> None:
        """The metric sinks, truncated to what a resumed checkpoint covers."""
        if self.is_main:
            self.sinks = Sinks.open(self.cfg, self.output_dir, updates_done, self.run_name, run_config)

    def print(self, text: str) -> None:
        if not self.is_main:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def start_progress(self, total: int, done: int) -> None:
        if self.bars:
            from tqdm.auto import tqdm  # imported here: only rank 0 with a bar needs it

            self.bar = tqdm(total=total, initial=done, desc=self.run_name, unit="step", dynamic_ncols=True)

    def stop_progress(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def update(self, row: Dict) -> None:
        """One optimizer update's metrics row: to the sinks, and to the bar (or a JSON line every
        ``logging.log_every`` updates without one)."""
        if not self.is_main:
            return
        self.sinks.write(row)
        if self.bar is not None:
            post = {"loss": f"{row['loss']:.4f}"}
            if "rewards/accuracy" in row:
                post["acc"] = f"{row['rewards/accuracy']:.2f}"
            if "unclamped_frac" in row:
                post["unclamped"] = f"{row['unclamped_frac']:.2f}"
            self.bar.set_postfix(post)
            self.bar.update(1)
        elif row["step"] % self.cfg.log_every == 0:
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)

    def evaluation(self, row: Dict) -> None:
        """A held-out evaluation's row (``kind: eval``): to the sinks, and its headline numbers printed."""
        if not self.is_main:
            return
        self.sinks.write(row)
        shown = {k: row[k] for k in EVAL_SHOWN if k in row}
        self.print(f"eval @ {row['step']}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()))

    def close(self) -> None:
        self.stop_progress()
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None

    def summary(self, updates: int, wall: float, times: StepTimes, eval_history: List[Dict], skipped: int,
                exit_code: int, extra_fields: Dict, sync_label: str, rollouts: bool) -> Dict[str, float]:
        """The run's summary: returned, and on rank 0 printed and written to ``summary.json``. ``sync_label``
        names what the sync share measures; ``rollouts``: the run generates (the wall-clock split is shown)."""
        summary = {"updates": updates, "wall_s": wall, "torch_threads": torch.get_num_threads(),
                   "deterministic": torch.are_deterministic_algorithms_enabled(), "skipped_updates": skipped,
                   "exit_code": exit_code, **provenance()}
        if times.step:
            total = max(sum(times.step), 1e-12)
            summary.update(mean_step_s=sum(times.step) / len(times.step), sync_frac=sum(times.sync) / total,
                           rollout_s=sum(times.rollout), rollout_frac=sum(times.rollout) / total)
        if eval_history:
            first, last = eval_history[0], eval_history[-1]
            for key in SUMMARY_EVAL_KEYS:
                if key in first and key in last:
                    summary[f"eval_start/{key}"] = first[key]
                    summary[f"eval_end/{key}"] = last[key]
        summary.update(extra_fields)  # the data (row counts, truncation) and the engine (compile) facts
        if self.is_main:
            print("\n".join(self._summary_lines(summary, times, eval_history, sync_label, rollouts)), flush=True)
            (self.output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def _summary_lines(self, summary: Dict, times: StepTimes, eval_history: List[Dict], sync_label: str,
                       rollouts: bool) -> List[str]:
        updates, skipped = summary["updates"], summary["skipped_updates"]
        lines = [f"== {self.run_name}: {skipped_words(updates, skipped)} in {summary['wall_s']:.1f}s =="]
        warning = skipped_warning(updates, skipped)
        if warning:
            lines.append(warning)
        if times.step:
            lines.append(f"mean step {summary['mean_step_s']:.3f}s, {sync_label} {100 * summary['sync_frac']:.2f}% "
                         "of step time")
            if rollouts:
                lines.append(
                    f"wall-clock split: generation + scoring {summary['rollout_s']:.1f}s "
                    f"({100 * summary['rollout_frac']:.1f}%), training {sum(times.step) - summary['rollout_s']:.1f}s"
                )
        if "compile_s" in summary:
            lines.append(f"compiled {summary['compiled_layers']} decoder layers ({summary['compile_backend']}): "
                         f"{summary['compiled_graphs']} graphs "
                         f"({summary['recompiles']} recompiles) in {summary['compile_s']:.1f}s of compile time")
        if eval_history:
            lines.append(f"held-out, start (update {eval_history[0]['step']}) -> end (update "
                         f"{eval_history[-1]['step']}):")
        for key, label in SUMMARY_EVAL_KEYS.items():
            if f"eval_start/{key}" in summary:
                lines.append(f"  {label}: {summary[f'eval_start/{key}']:.3f} -> {summary[f'eval_end/{key}']:.3f}")
        lines.append(f"outputs: {self.output_dir}/" + ", ".join(self.written()))
        if "metrics.jsonl" in self.written():  # the one command that plots this run (matplotlib: the eval/real extra)
            lines.append(f"plot: python -m eval.report {self.output_dir} -o {self.output_dir}/report")
        return lines

    def written(self) -> List[str]:
        """What the run directory holds that this summary points to (only what exists)."""
        out = self.output_dir
        found = [name for name in ("metrics.jsonl", "eval.jsonl")
                 if (out / name).is_file() and (out / name).stat().st_size]
        if any((out / "checkpoints").glob(f"{CHECKPOINT_PREFIX}*")):
            found.append("checkpoints/")
        if (out / FINAL_DIR).is_dir():
            found.append(f"{FINAL_DIR}/")
        return found
