"""``--rehearse``: one rank of a recipe's real world size, in one process, with every other rank faked.

``python launchers/run.py RECIPE --rehearse [--rehearse-rank R] [key=value ...]`` runs rank R (default: rank 0
and, under pipeline parallelism, the first rank of the last stage, each in a process of its own, one after the
other) of ``cluster.nodes x cluster.gpus_per_node`` ranks through the recipe's own trainer and engine
(DeepSpeed ZeRO 0-3 or megatron tp x pp, for real) under torch's fake process group, at the recipe's widths,
micro-batch and sequence length, for a few updates of its objective (humanline sync included), and prints
what it measured beside ``--plan`` for that rank (``report.py``). What each module does:

* ``world.py``: the fake world, the collective traffic counter and its bandwidth model;
* ``memory.py``: the memory measurements; ``kernels.py``: shape-only kernels (CPU);
* ``inputs.py``: the model config, tokenizer, data and overrides a rehearsal runs on (nothing downloaded,
  nothing written where a real run writes);
* ``run.py``: one rank, in this process.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import List, Optional

from .. import children
from ..config import load_recipe, run_shape
from .report import disagreements, render
from .run import rehearse_rank
from .world import ranks_to_rehearse

KERNELS = ("auto", "real", "shapes")
PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # the directory that holds this hl_core


def rehearse(recipe_path: str, overrides: List[str], rank: Optional[int] = None, kernels: str = "auto",
             micro_batches: Optional[int] = None, json_path: Optional[str] = None) -> int:
    """Rehearse ``rank`` here, or each rank of `ranks_to_rehearse` in a child process; print the reports
    and (``json_path``) write the results as a JSON list. Exit code: 0, or the first failing child's."""
    if rank is not None:
        result = rehearse_rank(recipe_path, overrides, rank, kernels, micro_batches)
        print(render(result), flush=True)
        if json_path:
            Path(json_path).write_text(json.dumps([result], default=float))
        return 0
    shape = run_shape(load_recipe(recipe_path, overrides))
    results = []
    with tempfile.TemporaryDirectory(prefix="hl_rehearsal_results_") as scratch:
        for child_rank in ranks_to_rehearse(shape, shape.world_size):
            out = Path(scratch) / f"rank{child_rank}.json"
            command = [sys.executable, "-m", "hl_core.rehearsal", recipe_path, *overrides, "--rank", str(child_rank),
                       "--kernels", kernels, "--json", str(out)]
            if micro_batches is not None:
                command += ["--micro-batches", str(micro_batches)]
            env = dict(os.environ,
                       PYTHONPATH=os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p))
            # in this process's care: a SIGTERM/SIGINT here is forwarded, and a SIGKILL here ends it too
            code = children.run(command, env=env).returncode
            if code != 0:
                return code
            results += json.loads(out.read_text())
    if json_path:
        Path(json_path).write_text(json.dumps(results, default=float))
    return 0


__all__ = ["KERNELS", "disagreements", "rehearse", "rehearse_rank", "render"]
