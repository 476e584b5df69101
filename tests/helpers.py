"""Test helpers: run the launcher or a torchrun script in a subprocess, read metrics."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY_HUMANLINE = REPO / "recipes" / "tiny" / "humanline_dpo.yaml"
TINY_OFFLINE = REPO / "recipes" / "tiny" / "offline_dpo.yaml"


def start_model_overrides(path) -> list:
    """The reproduction studies' arms start from the warm-up run's ``final/`` (and the preference study's offline
    arms train on data its weaker model writes), which do not exist on a fresh checkout: validate/plan them
    against the same architecture (the toy task's model config) and a few rows of the same shape instead."""
    path = Path(path)
    overrides = []
    if "repro" in path.parts and path.name != "warmup.yaml":
        overrides.append("model.name_or_path=tests/fixtures/toy_add/model")
    if "preference" in path.parts and "_offline" in path.name:  # the offline data the study's weaker model writes
        kind = "groups" if path.name.startswith("grpo") else "pairs"
        overrides.append(f"data.train.path=tests/fixtures/toy_add/pref_{kind}_sample.jsonl")
    return overrides


# Ports for rendezvous come from a block of 1000 per pytest-xdist worker (``gw0`` 11000-11999, ``gw1`` 12000-12999,
# no worker 10000-10999), below the kernel's ephemeral range (32768+ by default): two workers never pick the same
# port, and no outgoing connection (gloo's pairs, another test's client) can take it between the pick and the bind.
_PORT_BLOCK = 10000 + 1000 * (int(os.environ.get("PYTEST_XDIST_WORKER", "gw-1")[2:]) + 1)
_next_ports = itertools.count(os.getpid() % 1000)  # two runs outside xdist (both 10000-10999) start apart


def free_port() -> int:
    """The next port of this worker's block that nothing is bound to (each call a new one)."""
    for _ in range(1000):
        port = _PORT_BLOCK + next(_next_ports) % 1000
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # in use, or still in TIME_WAIT from an earlier run
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_BLOCK}-{_PORT_BLOCK + 999}")


_BASE_ENV = dict(os.environ)  # before any test's monkeypatching: what the zygotes start with


def _env(base=None):
    env = dict(os.environ if base is None else base)
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]))  # tests/: run_callbacks
    return env


def recipe_command(recipe, overrides=(), nproc: int = 1) -> list:
    """``python launchers/run.py`` (nproc 1) or ``torchrun --nproc_per_node N launchers/run.py``."""
    script = [str(REPO / "launchers" / "run.py"), str(recipe), *overrides, "logging.progress_bar=false"]
    if nproc == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
            *script]


# One-process runs go through `launchers/run.py`'s `main()` inside the test process (the same code path as the
# command line, minus a ~4 s interpreter start with torch, DeepSpeed and transformers imports); HL_TEST_SUBPROCESS=1
# runs every recipe in a subprocess instead.
IN_PROCESS = os.environ.get("HL_TEST_SUBPROCESS", "") != "1"


def run_here(args, call) -> subprocess.CompletedProcess:
    """``call()`` (it returns an exit code) run here as its subprocess would run: cwd at the repository, one torch
    thread; the environment, torch's global switches, the default generator's state and the process group restored
    afterwards (``restored_process_state``); stdout/stderr captured; an exception is exit code 1 with its traceback
    on stderr, a ``SystemExit`` its own code."""
    import contextlib
    import io

    import torch

    from launchers.in_process import guarded_call, restored_process_state

    out, err = io.StringIO(), io.StringIO()
    with restored_process_state():
        os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        torch.set_num_threads(1)
        with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code, failed = guarded_call(call)
    return subprocess.CompletedProcess(args, code if failed is None else failed, out.getvalue(), err.getvalue())


def run_in_process(args) -> subprocess.CompletedProcess:
    """``launchers/run.py`` ``args`` run by its ``main()`` here (``run_here``)."""
    import launchers.run as launcher

    return run_here(args, lambda: launcher.main([str(a) for a in args]))


def run_study(args, pool) -> subprocess.CompletedProcess:
    """``python -m eval.repro ARGS`` run by its ``cli()`` here (cwd at the repository, stdout/stderr captured) in
    ``pool``'s workers: the driver's code path minus its interpreter start and its workers' start-ups."""
    import contextlib
    import io

    from eval.repro.__main__ import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli([str(a) for a in args], pool=pool)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def pinned_for_these_kernels(pin: Path, actual: dict, kernels: dict, tmp_path: Path):
    """A study's pinned values for the CPU kernels that computed ``actual`` (``kernels``: the result's
    ``environment.kernel_fingerprint``, eval/repro/kernels.py), and the hint a mismatch prints.

    ``pin`` holds one entry per set of kernels (``{"pins": [{"kernels", "pinned", "values"}]}``): a warm-up of a few
    hundred updates turns one rounding difference into another model, so values compare only where the kernels
    computed the same bytes. The file written beside the test (``tmp_path/pin.name``) is ``pin`` with this machine's
    entry set to ``actual``: copying it over ``pin`` re-pins this machine, or adds it. With no entry for these
    kernels the test is skipped, saying which kinds of kernel differ from each pinned machine's."""
    import datetime

    import pytest

    from eval.repro.kernels import describe, differing

    stored = json.loads(pin.read_text())["pins"] if pin.exists() else []
    entries = [(e, differing(e["kernels"], kernels)) for e in stored]  # each pinned machine and how it differs
    mine = [e for e, kinds in entries if not kinds]
    fresh = tmp_path / pin.name
    entry = {"kernels": kernels, "pinned": datetime.date.today().isoformat(), "values": actual}
    fresh.write_text(json.dumps({"pins": [e for e, kinds in entries if kinds] + [entry]}, indent=1) + "\n")
    if not mine:
        why = "; ".join(f"{describe(e['kernels'])}: {', '.join(kinds)}" for e, kinds in entries)
        pytest.skip(f"no pin for this machine's kernels ({describe(kernels)}); "
                    + (f"the pinned machines' differ in {why}" if entries else "no machine is pinned yet")
                    + f". To pin this machine too: cp {fresh} {pin}")
    hint = (f"results moved: if on purpose, re-run the stored studies (docs/results/reproduction.md) and cp {fresh} "
            f"{pin}")
    return mine[0]["values"], hint


def rehearse(tmp_path, recipe, rank, *overrides, script=REPO / "launchers" / "run.py"):
    """``--rehearse-rank RANK`` of ``recipe`` in a fresh process: ``(the rank's result, its stdout)``; it must exit 0
    and write nothing into the recipe's ``output_dir``."""
    out_dir = tmp_path / "run"
    report = tmp_path / "rehearsal.json"
    command = [script, recipe, f"output_dir={out_dir}", *overrides, "--rehearse-rank", rank,
               "--rehearse-json", report]
    proc = run_fresh(command)  # a process of its own: the fake process group is process-wide
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert not out_dir.exists(), "a rehearsal wrote into the recipe's output_dir"
    assert "nothing written" in proc.stdout
    (result,) = json.loads(report.read_text())
    return result, proc.stdout


def plan_recipe(model: str = "meta-llama/Meta-Llama-3-8B-Instruct", *overrides: str):
    """The tiny humanline DPO recipe on ``model``'s shape (bf16, one sequence per micro-batch), as --plan's tests
    plan it."""
    from hl_core.config import load_recipe

    return load_recipe(TINY_HUMANLINE, [f"model.name_or_path={model}", "model.random_init=false",
                                        "model.attn_implementation=sdpa", "engine.precision=bf16",
                                        "train.micro_batch_size=1", "humanline.reference=copy", *overrides])


def run_recipe(recipe, overrides=(), nproc: int = 1, timeout: int = 600, expect: int = 0,
               torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run a recipe to its end; its exit code must be ``expect``. Several processes: their ranks forked from the
    zygotes (``run_ranks``), or the real ``torchrun`` with ``torchrun=True`` (or ``HL_TEST_ZYGOTES=0``)."""
    if nproc == 1 and IN_PROCESS:
        proc = run_in_process([recipe, *overrides, "logging.progress_bar=false"])
    elif nproc > 1 and ZYGOTES and not torchrun:
        proc = run_ranks(recipe_command(recipe, overrides, 1)[1:], nproc, timeout)
    else:
        proc = subprocess.run(recipe_command(recipe, overrides, nproc), cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=timeout)
    if proc.returncode != expect:
        raise AssertionError(
            f"run exited {proc.returncode}, expected {expect}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def start_recipe(recipe, overrides=(), nproc: int = 1, log=None, **env) -> subprocess.Popen:
    """Start a recipe in its own process group (output to the open file ``log``), with extra environment."""
    return subprocess.Popen(recipe_command(recipe, overrides, nproc), cwd=REPO, env={**_env(), **env}, stdout=log,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


# Several processes, or one fresh one: each forked from a zygote that has torch, DeepSpeed, transformers and
# megatron-core imported (tests/zygote.py: ~14 CPU seconds less per two-process run than torchrun's agent and fresh
# interpreters); HL_TEST_ZYGOTES=0 runs them under the real torchrun / a fresh interpreter instead. The launcher's own
# tests start torchrun themselves.
ZYGOTES = os.environ.get("HL_TEST_ZYGOTES", "") != "0"
_ranks = []  # this test process's zygotes (tests/zygote.Ranks), started at its first run that needs them


def run_ranks(argv, nproc: int, timeout: float, rendezvous: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC ARGV``'s job (``rendezvous``; else ``python ARGV``, one process), its
    processes forked from this test process's zygotes."""
    from zygote import Ranks  # only a run in processes of its own needs it

    if not _ranks:
        _ranks.append(Ranks(_env(_BASE_ENV), str(REPO)))
    return _ranks[0].run(argv, _env(), nproc, free_port() if rendezvous else None, timeout)


def run_fresh(argv, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python ARGV`` (a script and its arguments) in a process of its own, its exit code as it is: forked from a
    zygote, or a fresh interpreter under ``HL_TEST_ZYGOTES=0``. For a test whose state is process-wide."""
    if ZYGOTES:
        return run_ranks(argv, 1, timeout, rendezvous=False)
    return subprocess.run([sys.executable, *map(str, argv)], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def run_torchrun(script: Path, args=(), nproc: int = 2, timeout: int = 600) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC SCRIPT ARGS``: its ranks forked from the zygotes (``run_ranks``) unless
    ``HL_TEST_ZYGOTES=0``; must exit 0."""
    if ZYGOTES:
        proc = run_ranks([script, *args], nproc, timeout)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", str(script), *map(str, args)]
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_jsonl(path: Path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class RunsACommand:
    """Pickles as a call to ``os.system("touch MARKER")``: a hostile checkpoint object (loading it must run nothing)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def assert_same_rows(expected, got, name, tol: float = 1e-5) -> None:
    """Two runs' metric rows agree: the same keys, floats within ``tol`` (absolute and relative), the rest equal."""
    import math

    import pytest

    assert len(expected) == len(got), name
    for a, b in zip(expected, got):
        assert a.keys() == b.keys(), name
        for key, value in a.items():
            if isinstance(value, float) and not math.isnan(value):
                assert b[key] == pytest.approx(value, abs=tol, rel=tol), (name, a["step"], a.get("kind"), key)
            else:
                assert b[key] == value, (name, a["step"], key)


# the modules whose functions or classes tests/distributed/ workers replace with counting wrappers (a worker run
# in process gets its own state back from run_script_in_process only for modules loaded before it)
PATCHED_BY_WORKERS = ("hl_core.trainer", "hl_core.logprobs.packed", "hl_core.logprobs.hidden",
                      "hl_core.reference.store")


def _hl_core_namespaces() -> list:
    """Every loaded ``hl_core`` module and every class defined in one: what a worker script may patch."""
    spaces = []
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "hl_core" or name.startswith("hl_core.")):
            spaces.append(module)
            spaces += [obj for obj in vars(module).values() if isinstance(obj, type) and obj.__module__ == name]
    return spaces


def run_script_in_process(script: Path, args=()) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` run here (``runpy``, as ``__main__``; ``run_here``) with its ``sys.argv``; afterwards
    ``sys.argv``, ``sys.path`` and every ``hl_core`` module attribute or class attribute the script replaced (the
    workers patch counting wrappers in) are put back too."""
    import importlib
    import runpy

    for module in PATCHED_BY_WORKERS:  # loaded before their state is saved, so that it is saved
        importlib.import_module(module)

    def as_main() -> int:
        sys.argv = [str(script), *map(str, args)]
        runpy.run_path(str(script), run_name="__main__")
        return 0

    saved = [(space, dict(vars(space))) for space in _hl_core_namespaces()]
    argv, path = sys.argv[:], sys.path[:]
    try:
        return run_here([str(script), *args], as_main)
    finally:
        sys.argv[:], sys.path[:] = argv, path
        for space, before in saved:
            now = vars(space)
            for key, value in before.items():
                if key in now and now[key] is not value:
                    setattr(space, key, value)


def run_worker(script: Path, args=(), nproc: int = 1, timeout: int = 900,
               in_process: bool = True) -> subprocess.CompletedProcess:
    """A test worker script: plain ``python`` for one process (run here unless ``in_process`` is False or
    ``HL_TEST_SUBPROCESS=1``: a fresh interpreter's start-up and imports are seconds), ``torch.distributed.run``
    for several; must exit 0."""
    if nproc > 1:
        return run_torchrun(script, args, nproc=nproc, timeout=timeout)
    if in_process and IN_PROCESS:
        proc = run_script_in_process(script, args)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc
    proc = run_fresh([script, *args], timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc
