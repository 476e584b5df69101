"""One job across two network hosts, on the CPU: two network namespaces joined by a veth pair stand for two
machines (each its own network stack and addresses; the file system is shared, as on a cluster).

* torchrun on each "host" (``--nnodes 2``, c10d rendezvous on host A's veth address, gloo over the veth): the
  tiny humanline DPO recipe under ZeRO-3, one process per host, gives the same per-update metrics as the same
  two processes on one host.
Each torchrun runs in its namespace under its own host name (``unshare --uts``; ``/etc/netns/<name>/hosts``
maps both names to the veth addresses): torch's c10d rendezvous resolves the machine's own host name, which
the namespace's hosts file must know.

Not here (yet): the script ``launchers/slurm.py --nodes 2`` renders, run by a SLURM spanning both namespaces.

Needs root (``ip netns``, ``unshare``); skipped otherwise, with that reason.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, TINY_HUMANLINE, _env, assert_same_rows, read_jsonl, run_recipe

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("unshare") is None,
    reason="two network hosts need root and iproute2 (`ip netns`) and util-linux (`unshare`)",
)

TIMING = {"step_time_s", "sync_time_s", "tokens_per_s", "train_time_s", "rollout_time_s"}
OVERRIDES = ["engine.zero_stage=3", "train.max_steps=3", "eval.every=null", "checkpoint.save_every=null",
             "checkpoint.save_final=false", "logging.progress_bar=false"]
RUN_PY = REPO / "launchers" / "run.py"


def _metrics(out: Path) -> list:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read_jsonl(out / "metrics.jsonl")]


class TwoHosts:
    """Namespaces ``<tag>a`` / ``<tag>b`` with veth ends at ``10.231.<n>.1`` / ``.2``; removed by ``close``."""

    def __init__(self):
        n = os.getpid() % 250 + 1
        self.tag = f"hl{os.getpid()}"
        self.names = (f"{self.tag}a", f"{self.tag}b")
        self.links = (f"{self.tag}va", f"{self.tag}vb")
        self.addrs = (f"10.231.{n}.1", f"10.231.{n}.2")
        self.hostnames = (f"{self.tag}-node-a", f"{self.tag}-node-b")

    def open(self) -> "TwoHosts":
        ip = shutil.which("ip")
        for name in self.names:
            subprocess.run([ip, "netns", "add", name], check=True)
        subprocess.run([ip, "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]], check=True)
        for name, link, addr, host in zip(self.names, self.links, self.addrs, self.hostnames):
            subprocess.run([ip, "link", "set", link, "netns", name], check=True)
            subprocess.run([ip, "-n", name, "addr", "add", f"{addr}/24", "dev", link], check=True)
            subprocess.run([ip, "-n", name, "link", "set", link, "up"], check=True)
            subprocess.run([ip, "-n", name, "link", "set", "lo", "up"], check=True)
            etc = Path("/etc/netns") / name  # `ip netns exec` binds these over /etc inside the namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
                f"{a} {h}\n" for a, h in zip(self.addrs, self.hostnames)))
        return self

    def close(self) -> None:
        ip = shutil.which("ip")
        for name in self.names:
            subprocess.run([ip, "netns", "del", name], capture_output=True)  # takes its veth end (and the pair) along
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)

    def command(self, host: int, argv: list, hostname: bool = False) -> list:
        """``argv`` inside host ``host``'s network namespace (and, with ``hostname``, its own host name)."""
        inner = argv
        if hostname:
            inner = [shutil.which("unshare"), "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.hostnames[host],
                     *argv]
        return [shutil.which("ip"), "netns", "exec", self.names[host], *inner]


def _namespaces_refused() -> str:
    """Why this machine cannot make the namespaces (a container without CAP_SYS_ADMIN / CAP_NET_ADMIN), or ""."""
    probe = f"hlprobe{os.getpid()}"
    for argv in ([shutil.which("ip"), "netns", "add", probe], [shutil.which("unshare"), "--uts", "true"]):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            return f"`{' '.join(argv[1:])}` failed here: {done.stderr.strip()}"
    subprocess.run([shutil.which("ip"), "netns", "del", probe], capture_output=True)
    return ""


@pytest.fixture(scope="module")
def two_hosts():
    refused = _namespaces_refused()
    if refused:
        pytest.skip(f"two network hosts need namespaces: {refused}")
    hosts = TwoHosts()
    try:
        yield hosts.open()
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def one_host_metrics(tmp_path_factory):
    """The reference: the same two processes on one host (torchrun --nproc_per_node 2)."""
    out = tmp_path_factory.mktemp("one_host") / "run"
    run_recipe(TINY_HUMANLINE, [*OVERRIDES, f"output_dir={out}"], nproc=2, timeout=600)
    return _metrics(out)


def test_torchrun_across_two_hosts_matches_one_host(two_hosts, one_host_metrics, tmp_path):
    out, port = tmp_path / "run", 29611
    procs = []
    for host in (0, 1):
        env = {**_env(), "GLOO_SOCKET_IFNAME": two_hosts.links[host]}  # gloo's pairs over the veth, not loopback
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{two_hosts.addrs[0]}:{port}", "--rdzv-id", "two-hosts",
                    "--local-addr", two_hosts.addrs[host], "--max-restarts", "0",
                    str(RUN_PY), str(TINY_HUMANLINE), *OVERRIDES, f"output_dir={out}"]
        procs.append(subprocess.Popen(two_hosts.command(host, torchrun, hostname=True), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=600)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(log[-3000:] for log in logs)
    got = _metrics(out)
    assert [r["step"] for r in got] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in got)
    assert_same_rows(one_host_metrics, got, "two hosts vs one host", tol=1e-6)
