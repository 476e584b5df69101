"""What the examples share: their command line (``parser``), the model (``load_model``), and ``launch``, which
starts ``main(args)`` on ``nproc`` local processes (gloo on CPU) when the script was not started by a launcher; under
torchrun / deepspeed / srun (``RANK`` set) it runs in the calling process. The processes die with this one: each asks
the kernel for SIGKILL when its parent dies, and every one still alive is killed on any exit path. A refusal of the
humanline API (a bad argument, a checkpoint file that is damaged or would run code: ``hl_core.errors.UserError``) is
printed as its one paragraph by the process that met it, which exits 2 (a non-finite log-prob: 3), as the launcher
does. On CPU, DeepSpeed is told not to JIT-compile its shared-memory all-reduce (``no_shm_compile``): gloo's
collectives serve, and a first run needs no compiler. The guard that names a missing extra is in ``_extras.py``."""

import argparse
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM, PrinterCallback

from hl_core.errors import NonFiniteLogRatioError, UserError

TINY = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny"


def no_shm_compile() -> None:
    """On CPU, keep DeepSpeed from JIT-compiling its shared-memory all-reduce op (``deepspeed_shm_comm``: g++ and
    ninja, about two minutes on two cores, once per Python environment) when it makes its communication backend.

    DeepSpeed builds the op only if its probe lists it as compatible (``deepspeed.ops.__compatible_ops__``, a dict
    it computes once per process and keeps); marked incompatible, DeepSpeed uses torch.distributed's gloo
    collectives, as it does on platforms without the op. A no-op on GPUs (NCCL needs no such op) and when the
    example does not use DeepSpeed.
    """
    if "deepspeed" in sys.modules and not torch.cuda.is_available():
        sys.modules["deepspeed"].ops.__compatible_ops__["deepspeed_shm_comm"] = False


def load_model(path, seed):
    """The model's weights, fp32 (a directory with only a config: a seeded random init)."""
    if any(Path(path).glob("*.safetensors")) or not Path(path).is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)  # the tiny model ships as a config: the same random init on every rank
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)


def train_and_print(trainer) -> None:
    """A TRL trainer of ``hl_core.integrations.trl`` trained, then its per-update rows printed (rank 0)."""
    trainer.remove_callback(PrinterCallback)  # TRL's own log lines; the rows below say what humanline did
    trainer.train()
    for row in trainer.humanline_history if trainer.accelerator.is_main_process else ():
        print(f"update {row['update']}  loss {row['loss']:.8f}  clipped {row['clipped_frac']:.4f}  "
              f"synced {row['synced']}", flush=True)


def parser(doc: str) -> argparse.ArgumentParser:
    """The examples' shared options: model and data, the schedule, humanline's k and bounds."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(TINY / "model"), help="a model directory or hub name")
    p.add_argument("--data", default=str(TINY / "prefs" / "train.jsonl"), help="preference pairs (jsonl)")
    p.add_argument("--nproc", type=int, default=2, help="processes to start when not under a launcher")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="pairs per data-parallel rank per update")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--sync-every", type=int, default=2, help="humanline's k")
    p.add_argument("--clip", type=float, nargs=2, default=(-1.5, 1.5), metavar=("LOG_EPS_P", "LOG_EPS_R"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--max-prompt-length", type=int, default=32)
    p.add_argument("--checkpoint", help="resume from this directory when it holds a checkpoint; save there at a stop")
    p.add_argument("--stop-after", type=int, help="stop after this many updates (of all), saving --checkpoint")
    return p


def _refusals_as_paragraphs(main, args) -> None:
    """``main(args)``; a refusal is printed as its one paragraph and ends this process with its exit code."""
    try:
        main(args)
    except (UserError, NonFiniteLogRatioError) as exc:
        rank = os.environ.get("RANK", "0")
        print(f"error{f' (rank {rank})' if os.environ.get('WORLD_SIZE', '1') != '1' else ''}: {exc}",
              file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)


def _rank_main(rank, main, args, nproc, port):
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the parent, even on its SIGKILL
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    no_shm_compile()
    _refusals_as_paragraphs(main, args)


def launch(main, args, nproc: int) -> None:
    if "RANK" in os.environ or nproc == 1:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        no_shm_compile()
        return _refusals_as_paragraphs(main, args)
    context = mp.start_processes(_rank_main, (main, args, nproc, _free_port()), nprocs=nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    except mp.ProcessExitedException as exc:  # a rank refused (its paragraph is printed) or failed: end like it
        sys.exit(exc.exit_code if exc.exit_code and exc.exit_code > 0 else 1)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
