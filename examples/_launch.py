"""Start ``main(args)`` on ``nproc`` local processes (gloo on CPU) when the script was not started by a launcher;
under torchrun / deepspeed / srun (``RANK`` set) it runs in the calling process. The processes die with this one:
each asks the kernel for SIGKILL when its parent dies, and every one still alive is killed on any exit path."""

import ctypes
import os
import signal
import socket
import sys

import torch.multiprocessing as mp


def _rank_main(rank, main, args, nproc, port):
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the parent, even on its SIGKILL
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    main(args)


def launch(main, args, nproc: int) -> None:
    if "RANK" in os.environ or nproc == 1:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        return main(args)
    context = mp.start_processes(_rank_main, (main, args, nproc, _free_port()), nprocs=nproc, join=False,
                                 start_method="spawn")
    try:
        while not context.join():
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
