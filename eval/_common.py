"""Shared plumbing of the eval tools: offline mode, result files, model/data arguments."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from hl_core.errors import UserError

OFFLINE_ENV = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
LOCAL_EXTENSIONS = (".jsonl", ".json", ".parquet", ".pq")


class EvalError(UserError):
    """A mistake in the eval arguments (missing file, unknown judge, ...): the message names the fix."""


def require_matplotlib(what: str) -> None:
    """Refuse in one paragraph, before any work, when matplotlib (the `eval` and `real` extras) is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise EvalError(f"{what} needs matplotlib, which is not installed. Fix: `pip install matplotlib` (it comes "
                        "with the `eval` and `real` extras: `pip install -e \".[eval]\"`).")


def set_offline(offline: bool = True) -> None:
    """Forbid Hugging Face hub access for this process (set before the hub libraries are imported to be
    fully effective; ``huggingface_hub`` also reads the constant at call time in recent versions)."""
    if not offline:
        return
    for var in OFFLINE_ENV:
        os.environ[var] = "1"
    try:  # already-imported hub library: flip its constant too
        import huggingface_hub.constants as hc

        hc.HF_HUB_OFFLINE = True
    except Exception:
        pass
    try:
        import datasets.config as dc

        dc.HF_HUB_OFFLINE = True
    except Exception:
        pass


def is_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on") for v in OFFLINE_ENV)


def looks_local(source: str) -> bool:
    """A local data file (by extension or existence), as opposed to a Hugging Face dataset name."""
    return str(source).lower().endswith(LOCAL_EXTENSIONS) or os.path.exists(str(source))


def require_file(path: str, what: str) -> str:
    if not os.path.isfile(path):
        raise EvalError(
            f"{what} `{path}` does not exist (working directory {os.getcwd()}). Fix: give the path of an existing "
            f"local file, or a Hugging Face dataset name when the machine can reach the hub."
        )
    return path


def check_model_dir(model: Any, what: str = "model") -> None:
    """A local model directory ``model`` (a hub name or a loaded model passes) has intact files: a config.json, and
    safetensors files whose headers and sizes agree (``hl_core.models.loading.weight_files_problem``)."""
    if not isinstance(model, (str, Path)) or not os.path.isdir(model):
        return
    from hl_core.models.loading import weight_files_problem  # imported here: it imports torch

    problem = weight_files_problem(model)
    if problem is not None:
        raise EvalError(
            f"the {what} `{model}` cannot be loaded: {problem}. Fix: evaluate an intact model directory (a run's "
            "`final/`, or one saved with `save_pretrained`)."
        )


def check_finite_weights(model: Any, label: Any, what: str = "model") -> None:
    """The loaded ``model`` holds no NaN/inf weights (they would turn every sampled token or score into NaN)."""
    from hl_core.models.loading import nonfinite_parameter  # imported here: it imports torch

    name = nonfinite_parameter(model)
    if name is not None:
        raise EvalError(
            f"the {what} `{label}` has NaN or infinite weights (first: `{name}`), so everything it generates or "
            "scores would be NaN. Fix: evaluate a checkpoint from before the weights diverged (a run's `final/` is "
            "written only from finite weights), or retrain."
        )


def read_rows(path: str) -> List[Dict[str, Any]]:
    """Rows of a local ``.jsonl`` / ``.json`` (list, or JSON lines) / ``.parquet`` file."""
    from hl_core.data.rows import iter_file_rows

    require_file(path, "data file")
    return [row for _, row in iter_file_rows(path, None, "eval data", '{"...": "..."}')]


def write_json(path: Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(jsonable(obj), f, indent=2, ensure_ascii=False, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    return path


def write_jsonl(path: Path, rows: Iterable[Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(jsonable(row), ensure_ascii=False, allow_nan=False) + "\n")
    return path


def jsonable(obj: Any) -> Any:
    """Plain JSON values: numpy/torch scalars to Python numbers, NaN/inf to None, paths to strings."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    item = getattr(obj, "item", None)
    if callable(item):
        try:
            return jsonable(item())
        except Exception:
            pass
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):
        return jsonable(tolist())
    return str(obj)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_eval_dir(target: str) -> Path:
    """``RUN/eval`` for ``RUN/final`` (a trained run's model), else ``MODEL_DIR/eval``."""
    p = Path(target)
    if p.name == "final":
        return p.parent / "eval"
    return p / "eval"


def version_of(package: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:
        return None


def mean_std(values: List[float]) -> Dict[str, float]:
    """Mean and population standard deviation (ddof=0) of a non-empty list."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / n
    return {"mean": mean, "std": math.sqrt(var)}


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    """The JSON objects of a .jsonl file (blank lines skipped); a malformed line is an EvalError naming it."""
    rows = []
    with open(path, "r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise EvalError(f"{path}:{lineno}: not valid JSON ({exc.msg}). Fix: one JSON object a line.") from None
            if isinstance(row, dict):
                rows.append(row)
    return rows
