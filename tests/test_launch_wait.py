"""A launch that waits says what it waits for (issue 48): rank 0 of ``WORLD_SIZE=2`` started alone (a real
``launchers/run.py`` process, each engine) prints, 10 s into its wait for the process group, one line naming its
rank, ``MASTER_ADDR:MASTER_PORT``, the world size and the timeout; the test waits on that line, then kills the
process group."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time

import pytest

from helpers import REPO, TINY_HUMANLINE, _env, free_port, recipe_command

WAIT_S = 300.0  # bound on the whole wait: the process starts (imports, model) before it reaches the rendezvous


def _lines(stream, found: "queue.Queue[str]") -> None:
    for line in iter(stream.readline, ""):
        found.put(line)
    found.put("")


ENGINES = [(TINY_HUMANLINE, "2 min (DeepSpeed's, `DEEPSPEED_TIMEOUT` in minutes)"),
           (REPO / "recipes" / "tiny" / "megatron_humanline_dpo.yaml", "30 min (torch's default)")]


@pytest.mark.parametrize("recipe, gives_up", ENGINES, ids=["deepspeed", "megatron"])
def test_a_rank_without_its_peer_says_what_it_waits_for(tmp_path, recipe, gives_up):
    port = free_port()
    env = _env()
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               DEEPSPEED_TIMEOUT="2")
    cmd = recipe_command(recipe, [f"output_dir={tmp_path / 'run'}", "eval.every=null"])
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    found: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, found), daemon=True).start()
    seen, notice = [], None
    try:
        while notice is None:
            line = found.get(timeout=max(0.0, started + WAIT_S - time.monotonic()))
            assert line, f"the run ended ({proc.wait()}) without saying what it waits for:\n{''.join(seen)[-3000:]}"
            seen.append(line)
            notice = line if "has waited" in line else None
        elapsed = time.monotonic() - started
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert notice.startswith(f"rank 0 of WORLD_SIZE=2 has waited 10 s for the other ranks at 127.0.0.1:{port} "
                             f"(MASTER_ADDR:MASTER_PORT); it gives up after {gives_up}."), notice
    assert "`torchrun --nproc_per_node 2 launchers/run.py ...`" in notice and notice.count("\n") == 1
    print(f"the notice came {elapsed:.1f} s after the process started")
