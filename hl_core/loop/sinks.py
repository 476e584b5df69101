"""Metric sinks: ``metrics.jsonl`` always; TensorBoard and Weights & Biases when enabled in ``logging:``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List

from ..errors import RecipeError


def _parses(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except ValueError:
        return False


class JsonlSink:
    """One JSON object per line. On resume, rows with ``step > keep_up_to`` (and a torn last line) are dropped
    first, so a resumed run never duplicates steps logged after its checkpoint was written."""

    def __init__(self, path: Path, keep_up_to: int = -1):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: List[str] = []
        if keep_up_to >= 0 and path.exists():
            lines = [line for line in path.read_text().split("\n") if line.strip()]
            if lines and not _parses(lines[-1]):
                lines.pop()  # a row torn by a kill mid-write: the resumed run logs that update again
            kept = [line for line in lines if json.loads(line).get("step", -1) <= keep_up_to]
        path.write_text("".join(line + "\n" for line in kept))

    def write(self, row: Dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as fh:
            fh.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import (
                SummaryWriter,  # optional: `logging.tensorboard`
            )
        except ImportError:
            raise RecipeError(
                "`logging.tensorboard: true` needs the `tensorboard` package. Fix: `pip install tensorboard`, "
                "or set `logging.tensorboard=false`."
            )
        self.writer = SummaryWriter(str(log_dir))

    def write(self, row: Dict) -> None:
        prefix = "eval/" if row.get("kind") == "eval" else "train/"
        for key, value in row.items():
            if key not in ("step", "kind") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(prefix + key, value, row["step"])

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, cfg, run_name: str, config: Dict, output_dir: Path):
        try:
            import wandb  # optional: `logging.wandb.enabled`
        except ImportError:
            raise RecipeError(
                "`logging.wandb.enabled: true` needs the `wandb` package. Fix: `pip install wandb`, "
                "or set `logging.wandb.enabled=false`."
            )
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.run_name or run_name, config=config,
            mode=cfg.mode, dir=str(output_dir),
        )

    def write(self, row: Dict) -> None:
        prefix = "eval/" if row.get("kind") == "eval" else "train/"
        self.run.log({prefix + k: v for k, v in row.items() if k not in ("step", "kind")}, step=row["step"])

    def close(self) -> None:
        self.run.finish()


class _Only:
    """Route only rows of one kind to a sink."""

    def __init__(self, kind: str, sink):
        self.kind, self.sink = kind, sink

    def write(self, row: Dict) -> None:
        if row.get("kind", "train") == self.kind:
            self.sink.write({k: v for k, v in row.items() if k != "kind"})

    def close(self) -> None:
        self.sink.close()


class Sinks:
    def __init__(self, sinks):
        self.sinks = sinks

    @classmethod
    def open(cls, logging_cfg, output_dir: Path, updates_done: int, run_name: str, run_config: Dict) -> "Sinks":
        """``metrics.jsonl`` (a row per update, ``step`` = 0-based update index) and ``eval.jsonl``
        (``step`` = updates done when evaluated); both truncated to what the resumed checkpoint covers. Then
        TensorBoard and W&B as ``logging_cfg`` (the recipe's ``logging`` section) enables them; W&B gets
        ``run_name`` and the resolved recipe ``run_config``."""
        sinks = [
            _Only("train", JsonlSink(output_dir / "metrics.jsonl", updates_done - 1 if updates_done else -1)),
            _Only("eval", JsonlSink(output_dir / "eval.jsonl", updates_done if updates_done else -1)),
        ]
        if logging_cfg.tensorboard:
            sinks.append(TensorBoardSink(output_dir / "tensorboard"))
        if logging_cfg.wandb.enabled:
            sinks.append(WandbSink(logging_cfg.wandb, run_name, run_config, output_dir))
        return cls(sinks)

    def write(self, row: Dict) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
