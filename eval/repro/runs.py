"""The study driver's runs: one ``launchers/run.py`` process per (arm, warm-up, seed), ``jobs`` at a time, 1
thread each and deterministic algorithms; the supervised warm-ups, cached; the environment every result records."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import queue
import resource
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from hl_core import children

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
    cpu_s: Optional[float] = None  # CPU seconds of the run's process (None: not measured, runs sharing a process)
    curve: Tuple[List[int], List[float]] = field(default_factory=lambda: ([], []))  # held-out reward per eval
    win_rate: List[float] = field(default_factory=list)  # against the start policy, per eval (when reported)
    metrics: List[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    estimate_s: float = 0.0  # expected wall-clock (scheduling: longest first); 0 when unknown


# The same CPU kernels on every Intel x86-64 CPU with AVX2: ATen's own, MKL's (its conditional numerical
# reproducibility mode) and oneDNN's. Without them an AVX-512 machine rounds differently, and a warm-up of a few
# hundred updates amplifies that into another model (the quick grid's start accuracy moved from 0.17 to 0.13).
# MKL honours its AVX2 branch on Intel CPUs only (elsewhere it falls back to the CPU's own branch; only COMPATIBLE,
# SSE2, is common to all vendors, and it made the warm-up's updates 1.8x slower here), so every result records what
# the kernels computed (``kernel_fingerprint``, eval/repro/kernels.py) and curves are compared only under the same.
CPU_KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# The code paths every x86-64 CPU of any vendor takes alike: ATen's unvectorised kernels, MKL's COMPATIBLE branch
# (SSE2; the one MKL honours on every vendor's CPU) and oneDNN capped at SSE4.1. Slower (MKL 1.8x on the warm-up),
# so only the short vendor-neutral pin runs under them (tests/test_repro_neutral_pin.py).
NEUTRAL_KERNELS = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}


def child_env(kernels: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """One thread per process, fixed hashing, AVX2 kernels (or ``kernels``): the deterministic settings of every
    run."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", TOKENIZERS_PARALLELISM="false",
               **(CPU_KERNELS if kernels is None else kernels))
    return env


class Worker:
    """One ``python -m eval.repro.worker`` process (``child_env()``): runs tasks one after another. It ends with
    the driver (``hl_core.children``: its own process group, the death signal, the lifeline it watches)."""

    def __init__(self, log: Path, kernels: Optional[Dict[str, str]] = None):
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with log.open("a") as err:
            self.proc = children.popen([sys.executable, "-m", "eval.repro.worker"], cwd=REPO,
                                       env=child_env(kernels),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)

    def ask(self, task: dict) -> dict:
        """The task's answer; a worker that died is code -1 (its last words are in ``self.log``)."""
        try:
            self.proc.stdin.write(json.dumps(task) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            self.proc.wait()
            return {"code": -1, "result": None, "died": f"worker exited {self.proc.returncode}; see {self.log}"}
        return json.loads(line)

    def close(self) -> None:
        """Idle: its input ends and it exits; then (or busy, or stuck) its process group is ended."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        children.end(self.proc)


class WorkerPool:
    """Up to ``jobs`` workers, started on demand and reused by every run of a study (one import of torch,
    DeepSpeed and transformers per worker, not per run). A worker that died is replaced by a fresh one.
    ``HL_REPRO_SUBPROCESS=1`` runs every training run in its own ``launchers/run.py`` process instead."""

    def __init__(self, jobs: int, log_dir: Path, kernels: Optional[Dict[str, str]] = None):
        self.jobs, self.log_dir = jobs, log_dir
        self.cpu_kernels = kernels  # the kernel switches of its workers (None: CPU_KERNELS)
        self.idle: "queue.Queue[Worker]" = queue.Queue()
        self.started = 0
        self.workers: List[Worker] = []  # every worker started, idle or busy: `close` ends them all
        self.lock = threading.Lock()
        self.subprocess = os.environ.get("HL_REPRO_SUBPROCESS", "") == "1"
        self.kernels: Optional[Dict[str, str]] = None  # kernel_fingerprint(), once taken

    def ask(self, task: dict) -> dict:
        with self.lock:
            if self.idle.empty() and self.started < self.jobs:
                self.started += 1
                self.workers.append(Worker(self.log_dir / f"worker{self.started}.log", self.cpu_kernels))
                self.idle.put(self.workers[-1])
        worker = self.idle.get()
        try:
            answer = worker.ask(task)
        finally:
            with self.lock:
                if worker in self.workers and worker.proc.poll() is None:
                    self.idle.put(worker)
                elif worker in self.workers:  # it died: a fresh one replaces it (not one `close` ended)
                    self.workers.remove(worker)
                    self.started -= 1
                    children.end(worker.proc)
        return answer

    def close(self) -> None:
        """Every worker ends, busy ones too (their runs are cut short): on every way out of a study."""
        while not self.idle.empty():
            self.idle.get()
        with self.lock:
            workers, self.workers, self.started = self.workers, [], 0
        for worker in workers:  # idle ones see their input end and exit at once
            if worker.proc.poll() is None:
                try:
                    worker.proc.stdin.close()
                except OSError:
                    pass
        children.end_all([worker.proc for worker in workers])  # busy ones: SIGTERM, SIGKILL 2 s later

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def children_cpu_s() -> float:
    """User + system CPU seconds of the child processes this process has waited for."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(run: Run, pool: WorkerPool) -> Run:
    """Train one (arm, warm-up, seed) through ``launchers/run.py``'s ``main()`` in a pool worker (the command
    line's code path); reads its curve and metrics back."""
    run.output_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(run.recipe), *run.overrides, f"output_dir={run.output_dir}", "logging.progress_bar=false",
            "checkpoint.resume=never",
            "checkpoint.overwrite=true"]  # a rerun of the study trains each arm afresh in its directory
    cmd = [sys.executable, str(REPO / "launchers" / "run.py"), *argv]
    log = run.output_dir / "driver.log"
    start = time.perf_counter()
    if pool.subprocess:
        cpu = children_cpu_s()
        proc = children.run(cmd, cwd=REPO, env=child_env(pool.cpu_kernels), capture_output=True, text=True)
        log.write_text(proc.stdout + proc.stderr)
        # the children's CPU is this run's alone only when no other run ends meanwhile
        answer = {"code": proc.returncode, "cpu_s": children_cpu_s() - cpu if pool.jobs == 1 else None}
    else:
        answer = pool.ask({"argv": argv, "log": str(log)})
    run.wall_s = time.perf_counter() - start
    run.cpu_s = answer.get("cpu_s")
    if answer["code"] != 0:
        text = log.read_text() if log.exists() else ""
        tail = "\n".join((text.strip().splitlines() + [answer.get("died", "")])[-25:])
        raise RunFailed(f"run {run.arm} warm-up {run.warmup} seed {run.seed} failed (exit {answer['code']}); full "
                        f"log: {log}\ncommand: {' '.join(cmd)}\n{tail}")
    evals = read_jsonl(run.output_dir / "eval.jsonl")
    run.curve = ([int(r["step"]) for r in evals], [float(r["reward"]) for r in evals])
    run.win_rate = [float(r["win_rate_vs_start"]) for r in evals if "win_rate_vs_start" in r]
    run.metrics = read_jsonl(run.output_dir / "metrics.jsonl")
    summary_path = run.output_dir / "summary.json"
    run.summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return run


def run_all(runs: Sequence[Run], pool: WorkerPool, title: str, bar=None) -> List[Run]:
    """Run ``runs`` ``pool.jobs`` at a time in ``pool``'s workers, printing one line per finished run; ``bar`` is
    a progress bar shared by several calls (else one of its own: tqdm shows the ETA). Runs start longest first
    when they carry an estimate (``Run.estimate_s``), so a stage does not end on one long run while the other
    workers idle."""
    from tqdm import tqdm  # the progress bar; not needed by the importers of this module's other parts

    own_bar = bar is None
    bar = bar or tqdm(total=len(runs), desc=title, unit="run")
    done: List[Run] = []
    try:
        with ThreadPoolExecutor(max_workers=pool.jobs) as executor:
            ordered = sorted(runs, key=lambda r: -r.estimate_s)
            futures = {executor.submit(run_one, r, pool): r for r in ordered}
            try:
                for future in as_completed(futures):
                    run = future.result()
                    done.append(run)
                    if run.curve[1]:
                        bar.write(f"  {run.arm:<30} warm-up {run.warmup} seed {run.seed}: {run.wall_s:5.1f}s, "
                                  f"held-out {run.curve[1][0]:.3f} -> {run.curve[1][-1]:.3f}")
                    bar.update(1)
            except BaseException:  # a failed run, Ctrl-C, SIGTERM: the workers end first, so the threads that wait
                for future in futures:  # on them return and the executor can close
                    future.cancel()
                pool.close()
                raise
    finally:
        if own_bar:
            bar.close()
    order = {(r.arm, r.warmup, r.seed): i for i, r in enumerate(runs)}
    return sorted(done, key=lambda r: order[(r.arm, r.warmup, r.seed)])


def warmup_dir(out: Path, overrides: Sequence[str], seed: int, name: str = "warmup") -> Path:
    """Where the warm-up (``overrides``, ``seed``) is cached: keyed by the recipe, its data, the overrides and
    the seed; its model is ``<dir>/final`` once trained."""
    run_overrides = [*overrides, f"train.seed={seed}"]
    key = hashlib.sha256(WARMUP_RECIPE.read_bytes() + WARMUP_DATA.read_bytes()
                         + repr(run_overrides).encode()).hexdigest()[:16]
    return out / f"{name}-{key}"


def warmup_run(out: Path, overrides: Sequence[str], seed: int, name: str = "warmup") -> Optional[Run]:
    """The run that trains the warm-up (``overrides``, ``seed``) into ``warmup_dir``; None when it is cached."""
    directory = warmup_dir(out, overrides, seed, name)
    if (directory / "final" / "config.json").exists():
        return None
    return Run(name, seed, WARMUP_RECIPE, [*overrides, f"train.seed={seed}", "checkpoint.save_final=true"], directory,
               warmup=seed)


def warmups(out: Path, overrides: Sequence[str], seeds: Sequence[int], pool: WorkerPool,
            name: str = "warmup") -> Dict[int, Path]:
    """Supervised warm-ups (``recipes/repro/warmup.yaml`` + ``overrides``, ``train.seed`` = each of ``seeds``:
    initialisation and data order), each cached while the recipe, its data, the overrides and the seed are
    unchanged; the missing ones run in parallel. Returns ``{seed: final model directory}``."""
    models: Dict[int, Path] = {}
    todo: List[Run] = []
    for seed in seeds:
        models[seed] = warmup_dir(out, overrides, seed, name) / "final"
        run = warmup_run(out, overrides, seed, name)
        if run is None:
            print(f"{name} {seed}: cached at {models[seed]}")
        else:
            todo.append(run)
    if todo:
        print(f"{name}: supervised training of {len(todo)} model(s) -> {out}")
        run_all(todo, pool, name)
    return models


WARMUP_EVAL = ("data.eval.path=tests/fixtures/toy_add/prompts_eval.jsonl", "data.eval.limit=256", "eval.at_start=false",
               "eval.held_out=reward", "rollout.reward.kind=math", "rollout.temperature=1.0",
               "rollout.max_new_tokens=4")


def policy_warmup(grid) -> Tuple[List[str], int]:
    """The policy warm-ups' overrides (``grid``'s, held-out accuracy at the end) and their number of updates."""
    from hl_core.config import load_recipe  # the recipe schema: only the warm-up's length is needed here

    steps = load_recipe(WARMUP_RECIPE, list(grid.warmup_overrides)).train.max_steps
    return [*grid.warmup_overrides, *WARMUP_EVAL, f"eval.every={steps}"], steps


def accepted_warmups(cache: Path, grid, count: int, pool: WorkerPool) -> Tuple[Dict[int, Path], List[dict]]:
    """The first ``count`` warm-up seeds (0, 1, 2, ...) whose held-out accuracy at the end of the warm-up (one
    sampled answer per held-out problem, the arms' measure) reaches ``grid.warmup_min_accuracy``: a warm-up that
    did not learn the task is not a start. Returns the accepted models and every tried seed's accuracy."""
    overrides, _ = policy_warmup(grid)
    models: Dict[int, Path] = {}
    table: List[dict] = []
    seed = 0
    while len(models) < count:
        if seed >= 2 * count + 2:
            raise RunFailed(f"only {len(models)} of {seed} warm-up seeds reached held-out accuracy "
                            f"{grid.warmup_min_accuracy} (tried: {table}); check recipes/repro/warmup.yaml")
        batch = list(range(seed, seed + count - len(models)))
        built = warmups(cache, overrides, batch, pool)
        for s in batch:
            accuracy = float(read_jsonl(built[s].parent / "eval.jsonl")[-1]["reward"])
            table.append({"seed": s, "accuracy": accuracy, "accepted": accuracy >= grid.warmup_min_accuracy})
            if table[-1]["accepted"]:
                models[s] = built[s]
            else:
                print(f"warm-up {s}: held-out accuracy {accuracy:.3f} < {grid.warmup_min_accuracy}: not a start, "
                      "drawing the next seed")
        seed += len(batch)
    return models, table


def kernel_fingerprint(pool: "WorkerPool") -> Dict[str, str]:
    """What the runs' CPU kernels compute (``eval.repro.kernels``), measured once per pool in the runs' own
    environment (a worker task, or ``python -m eval.repro.kernels`` under ``HL_REPRO_SUBPROCESS=1``)."""
    if pool.kernels is None:
        if pool.subprocess:
            proc = children.run([sys.executable, "-m", "eval.repro.kernels"], cwd=REPO,
                                env=child_env(pool.cpu_kernels),
                                capture_output=True, text=True)
            pool.kernels = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
        else:
            answer = pool.ask({"call": "eval.repro.kernels:fingerprint", "log": str(pool.log_dir / "kernels.log")})
            pool.kernels = answer["result"] if answer["code"] == 0 else {}
        if not pool.kernels:
            raise RunFailed(f"the CPU kernels' fingerprint could not be taken; see {pool.log_dir}")
    return pool.kernels


def environment(pool: "WorkerPool") -> dict:
    """Versions, CPU count, parallel jobs, the git commit and the kernels' fingerprint: what every result file
    records. Two results are comparable to the last bit only where ``kernel_fingerprint`` is the same."""
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
        "numpy": numpy.__version__, "git_commit": commit or None, "parallel_jobs": pool.jobs,
        "threads_per_process": 1, "deterministic_algorithms": True,
        "cpu_kernels": " ".join(f"{k}={v}" for k, v in (pool.cpu_kernels or CPU_KERNELS).items()),
        "kernel_fingerprint": kernel_fingerprint(pool),
    }
