"""Replayed rollouts (``rollout.replay``): the groups a run logged with ``rollout.log_samples`` are read back instead
of generated, so several runs train on one sampled set (an offline set sampled once and shared by the arms of a
study).

A logged row is ``{"rollout_step", "train_step", "position", "prompt", "reference", "completion_ids",
"completions", "scores"}`` (``hl_core.rollout.RolloutSource``). A replaying run takes, at its rollout update ``n``,
the rows of ``train_step`` ``n .. n + every - 1`` and ``position`` (the global data position of the prompt), each
row's completion token ids and scores as they were logged, so its examples are token for token those of the run
that sampled them. Everything else (the behaviour policy's log-probs, the reference, the update) is computed by the
replaying run. A row must exist for every (update, position) the run needs, have been sampled at the same rollout
update and hold the same prompt and reference answer: a log of other data, another ``train.seed``, batch layout or
``rollout.every`` is refused, never silently mixed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from ..errors import DataError

FIELDS = ("rollout_step", "train_step", "position", "prompt", "reference", "completion_ids", "completions", "scores")
FIX = ("Fix: point `rollout.replay` at the `rollouts/` folder of a run with `rollout.log_samples: true` and the same "
       "data, `train.seed`, batch layout, `train.max_steps`, `rollout.every` and `rollout.num_generations`")


def log_files(folder: Path) -> List[Path]:
    """The samples logs a ``rollout.replay`` path names: ``rank*.jsonl`` in a folder, or one ``.jsonl`` file."""
    if folder.is_file():
        return [folder]
    return sorted(folder.glob("rank*.jsonl")) if folder.is_dir() else []


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _row_problem(row, num_generations: int) -> str:
    """What is wrong with one logged row ('' when nothing)."""
    if not isinstance(row, dict):
        return f"the row is a {type(row).__name__}, not an object"
    missing = [f for f in FIELDS if f not in row]
    if missing:
        return f"it lacks {', '.join(f'`{f}`' for f in missing)}"
    if not all(_is_int(row[f]) and row[f] >= 0 for f in ("rollout_step", "train_step", "position")):
        return "`rollout_step`, `train_step` and `position` must be non-negative integers"
    ids, texts, scores = row["completion_ids"], row["completions"], row["scores"]
    if not all(isinstance(v, list) and len(v) == num_generations for v in (ids, texts, scores)):
        return (f"`completion_ids`, `completions` and `scores` must each be a list of {num_generations} entries "
                "(`rollout.num_generations`)")
    if not all(isinstance(c, list) and all(_is_int(t) and t >= 0 for t in c) for c in ids):
        return "`completion_ids` must be lists of token ids"
    if not all(isinstance(t, str) for t in texts) or not all(_is_number(s) for s in scores):
        return "`completions` must be strings and `scores` numbers"
    return ""


class SampleReplay:
    """The logged groups of a folder, keyed by (train step, data position).

    Args:
        path: ``rollout.replay``: a ``rollouts/`` folder (every ``rank*.jsonl`` in it) or one ``.jsonl`` file.
        num_generations: ``rollout.num_generations``; every logged group must have this many completions.

    Raises:
        DataError: no log there, a malformed or duplicated row (naming ``file:line``).
    """

    def __init__(self, path: str, num_generations: int):
        self.path = Path(path)
        files = log_files(self.path)
        if not files:
            raise DataError(f"`rollout.replay: {path}` holds no samples log (`rank*.jsonl`). {FIX}.")
        self.rows: Dict[Tuple[int, int], Tuple[dict, str]] = {}
        for file in files:
            for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
                if line.strip():
                    self._add(line, f"{file}:{number}", num_generations)

    def _add(self, line: str, source: str, num_generations: int) -> None:
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise DataError(f"{source}: not a JSON object ({exc}). {FIX}.") from None
        problem = _row_problem(row, num_generations)
        if problem:
            raise DataError(f"{source}: {problem}, so it is not a group logged by `rollout.log_samples`. {FIX}.")
        key = (row["train_step"], row["position"])
        if key in self.rows:
            raise DataError(f"{source}: a second group for update {key[0]}, data position {key[1]} (the first is at "
                            f"{self.rows[key][1]}): two runs' logs in one folder. {FIX}.")
        self.rows[key] = (row, source)

    def groups(self, rollout_step: int, train_step: int, positions: Sequence[int],
               prompts: Sequence[dict]) -> Tuple[List[List[List[int]]], List[str], List[float]]:
        """The logged groups of ``positions`` at ``train_step``, checked against the run's own prompts.

        Args:
            rollout_step: the run's rollout update (the logged group must have been sampled there too).
            train_step: the update the groups train.
            positions: the prompts' global data positions.
            prompts: the run's prompt features at those positions (``messages``, ``reference``).

        Returns:
            ``(completion ids per prompt, completion texts, scores)``, texts and scores flat, prompt-major.
        """
        ids, texts, scores = [], [], []
        for position, prompt in zip(positions, prompts):
            found = self.rows.get((train_step, position))
            if found is None:
                raise DataError(f"`rollout.replay: {self.path}` has no group for update {train_step}, data position "
                                f"{position}. {FIX}.")
            row, source = found
            if row["rollout_step"] != rollout_step:
                raise DataError(f"{source}: the group of update {train_step} was sampled at update "
                                f"{row['rollout_step']}, but this run samples it at update {rollout_step} (another "
                                f"`rollout.every`). {FIX}.")
            if row["prompt"] != prompt["messages"] or row["reference"] != prompt["reference"]:
                raise DataError(f"{source}: the logged prompt {row['prompt']!r} (answer {row['reference']!r}) is not "
                                f"this run's prompt at data position {position} ({prompt['messages']!r}, answer "
                                f"{prompt['reference']!r}). {FIX}.")
            ids.append([list(c) for c in row["completion_ids"]])
            texts += row["completions"]
            scores += [float(s) for s in row["scores"]]
        return ids, texts, scores
