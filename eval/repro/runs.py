"""The study driver's runs: one ``launchers/run.py`` process per (arm, warm-up, seed), ``jobs`` at a time, 1
thread each and deterministic algorithms; the supervised warm-ups, cached; the environment every result records."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from .._common import read_jsonl

REPO = Path(__file__).resolve().parents[2]
WARMUP_RECIPE = REPO / "recipes" / "repro" / "warmup.yaml"
WARMUP_DATA = REPO / "tests" / "fixtures" / "toy_add" / "sft_train.jsonl"


class RunFailed(RuntimeError):
    """One training run of the study exited non-zero (its log is in ``<run dir>/driver.log``)."""


@dataclass
class Run:
    arm: str
    seed: int
    recipe: Path
    overrides: List[str]
    output_dir: Path
    warmup: int = 0  # the warm-up model's seed
    wall_s: float = 0.0
    curve: Tuple[List[int], List[float]] = field(default_factory=lambda: ([], []))  # held-out reward per eval
    win_rate: List[float] = field(default_factory=list)  # against the start policy, per eval (when reported)
    metrics: List[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)


# The same CPU kernels on every x86-64 CPU with AVX2: ATen's own, MKL's (its conditional numerical
# reproducibility mode) and oneDNN's. Without them an AVX-512 machine rounds differently, and a warm-up of a few
# hundred updates amplifies that into another model (the quick grid's start accuracy moved from 0.17 to 0.13).
CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def child_env() -> Dict[str, str]:
    """One thread per process, fixed hashing, AVX2 kernels: the deterministic settings of every run."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false",
               **CPU_KERNELS)
    return env


def run_one(run: Run) -> Run:
    """Train one (arm, warm-up, seed) through ``launchers/run.py``; reads its curve and metrics back."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "launchers" / "run.py"), str(run.recipe), *run.overrides,
           f"output_dir={run.output_dir}", "logging.progress_bar=false", "checkpoint.resume=never",
           "checkpoint.overwrite=true"]  # a rerun of the study trains each arm afresh in its directory
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    run.wall_s = time.perf_counter() - start
    (run.output_dir / "driver.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise RunFailed(f"run {run.arm} warm-up {run.warmup} seed {run.seed} failed (exit {proc.returncode}); full "
                        f"log: {run.output_dir / 'driver.log'}\ncommand: {' '.join(cmd)}\n{tail}")
    evals = read_jsonl(run.output_dir / "eval.jsonl")
    run.curve = ([int(r["step"]) for r in evals], [float(r["reward"]) for r in evals])
    run.win_rate = [float(r["win_rate_vs_start"]) for r in evals if "win_rate_vs_start" in r]
    run.metrics = read_jsonl(run.output_dir / "metrics.jsonl")
    summary_path = run.output_dir / "summary.json"
    run.summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return run


def run_all(runs: Sequence[Run], jobs: int, title: str) -> List[Run]:
    """Run ``runs`` ``jobs`` at a time, printing one line per finished run (tqdm shows the ETA)."""
    from tqdm import tqdm

    done: List[Run] = []
    with ThreadPoolExecutor(max_workers=jobs) as pool, tqdm(total=len(runs), desc=title, unit="run") as bar:
        futures = {pool.submit(run_one, r): r for r in runs}
        for future in as_completed(futures):
            run = future.result()
            done.append(run)
            if run.curve[1]:
                bar.write(f"  {run.arm:<22} warm-up {run.warmup} seed {run.seed}: {run.wall_s:5.1f}s, held-out "
                          f"{run.curve[1][0]:.3f} -> {run.curve[1][-1]:.3f}")
            bar.update(1)
    order = {(r.arm, r.warmup, r.seed): i for i, r in enumerate(runs)}
    return sorted(done, key=lambda r: order[(r.arm, r.warmup, r.seed)])


def warmups(out: Path, overrides: Sequence[str], seeds: Sequence[int], jobs: int, name: str = "warmup") -> Dict[int, Path]:
    """Supervised warm-ups (``recipes/repro/warmup.yaml`` + ``overrides``, ``train.seed`` = each of ``seeds``:
    initialisation and data order), each cached while the recipe, its data, the overrides and the seed are
    unchanged; the missing ones run in parallel. Returns ``{seed: final model directory}``."""
    models: Dict[int, Path] = {}
    todo: List[Run] = []
    for seed in seeds:
        run_overrides = [*overrides, f"train.seed={seed}"]
        key = hashlib.sha256(WARMUP_RECIPE.read_bytes() + WARMUP_DATA.read_bytes()
                             + repr(run_overrides).encode()).hexdigest()[:16]
        directory = out / f"{name}-{key}"
        models[seed] = directory / "final"
        if (models[seed] / "config.json").exists():
            print(f"{name} {seed}: cached at {models[seed]}")
        else:
            todo.append(Run(name, seed, WARMUP_RECIPE, [*run_overrides, "checkpoint.save_final=true"], directory,
                            warmup=seed))
    if todo:
        print(f"{name}: supervised training of {len(todo)} model(s) -> {out}")
        run_all(todo, jobs, name)
    return models


def environment(jobs: int) -> dict:
    """Versions, CPU count, parallel jobs and the git commit: what every result file records."""
    import deepspeed
    import numpy
    import torch
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
        "numpy": numpy.__version__, "git_commit": commit or None, "parallel_jobs": jobs,
        "threads_per_process": 1, "deterministic_algorithms": True,
        "cpu_kernels": " ".join(f"{k}={v}" for k, v in CPU_KERNELS.items()),
    }
