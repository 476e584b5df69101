"""One job across two network hosts, on the CPU: two network namespaces joined by a veth pair stand for two
machines (each its own network stack and addresses; the file system is shared, as on a cluster).

* torchrun on each "host" (``--nnodes 2``, c10d rendezvous on host A's veth address, gloo over the veth): the
  tiny humanline DPO recipe under ZeRO-3, one process per host, gives the same per-update metrics as the same
  two processes on one host.
Each torchrun runs in its namespace under its own host name (``unshare --uts``; ``/etc/netns/<name>/hosts``
maps both names to the veth addresses): torch's c10d rendezvous resolves the machine's own host name, which
the namespace's hosts file must know.

* SLURM across the two hosts: slurmctld on host A, one ``slurmd -N <host name>`` per host (NodeAddr = its veth
  address, started inside its namespace and host name, so the job steps it starts inherit both), one munged whose
  socket file both reach. The script ``launchers/slurm.py RECIPE --nodes 2 --gpus-per-node 1 --cpu`` renders and
  submits with sbatch (from host A) runs one torchrun per node; its per-update metrics equal the same two
  processes on one host. ``--cpu`` is the only difference from a GPU cluster's script: no ``#SBATCH
  --gpus-per-node`` request and ``CUDA_VISIBLE_DEVICES=''`` (so gloo, not nccl).

Needs root (``ip netns``, ``unshare``, ``nsenter``); skipped otherwise, with that reason; the SLURM test also needs
Debian's ``slurm-wlm`` and ``munge`` (installed as root when missing, skipped with the reason otherwise).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from capabilities import missing, require
from helpers import REPO, TINY_HUMANLINE, _env, assert_same_rows, read_jsonl, run_recipe
from slurm_cluster import LocalSlurm, ensure_slurm_installed

TIMING = {"step_time_s", "sync_time_s", "tokens_per_s", "train_time_s", "rollout_time_s"}
OVERRIDES = ["engine.zero_stage=3", "train.max_steps=3", "eval.every=null", "checkpoint.save_every=null",
             "checkpoint.save_final=false", "logging.progress_bar=false"]
RUN_PY = REPO / "launchers" / "run.py"
SLURM_PY = REPO / "launchers" / "slurm.py"


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
        for pid in self.leftover_pids():
            os.kill(pid, signal.SIGKILL)
        for name in self.names:
            subprocess.run([ip, "netns", "del", name], capture_output=True)  # takes its veth end (and the pair) along
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)

    def command(self, host: int, argv: list) -> list:
        """``argv`` on host ``host``: in its network namespace, under its own host name (a UTS namespace), with its
        hosts file bound over /etc/hosts in a private mount namespace. That is ``ip netns exec`` without the fresh
        sysfs it mounts on /sys: slurmd (22.05) needs the machine's /sys/fs/cgroup and fails under ``ip netns exec``
        with "No filesystem mounted on /sys/fs/cgroup" / "Unable to initialize cgroup plugin"."""
        script = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        return [shutil.which("nsenter"), f"--net=/run/netns/{self.names[host]}", shutil.which("unshare"), "--mount",
                "--uts", "sh", "-c", script, f"/etc/netns/{self.names[host]}/hosts", self.hostnames[host], *argv]

    def leftover_pids(self) -> list:
        """Processes still running in the namespaces (all started by the tests)."""
        return [int(pid) for name in self.names for pid in subprocess.run(
            [shutil.which("ip"), "netns", "pids", name], capture_output=True, text=True).stdout.split()]


def _namespaces_refused() -> str:
    """Why this machine cannot make the namespaces (a container without CAP_SYS_ADMIN / CAP_NET_ADMIN), or ""."""
    probe = f"hlprobe{os.getpid()}"
    for argv in ([shutil.which("ip"), "netns", "add", probe], [shutil.which("unshare"), "--mount", "--uts", "true"]):
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            return f"`{' '.join(argv[1:])}` failed here: {done.stderr.strip()}"
    subprocess.run([shutil.which("ip"), "netns", "del", probe], capture_output=True)
    return ""


@pytest.fixture(scope="module")
def two_hosts():
    if os.geteuid() != 0 or any(shutil.which(tool) is None for tool in ("ip", "unshare", "nsenter")):
        missing("network namespaces", "two network hosts need root, iproute2 (`ip netns`) and util-linux "
                "(`unshare`, `nsenter`)")
    require("network namespaces", _namespaces_refused())
    hosts = TwoHosts()
    try:
        yield hosts.open()
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def one_host_metrics(tmp_path_factory):
    """The reference: the same two processes on one host, under the real torchrun (--nproc_per_node 2) as on the
    two hosts."""
    out = tmp_path_factory.mktemp("one_host") / "run"
    run_recipe(TINY_HUMANLINE, [*OVERRIDES, f"output_dir={out}"], nproc=2, timeout=600, torchrun=True)
    return _metrics(out)


def test_torchrun_across_two_hosts_matches_one_host(two_hosts, one_host_metrics, tmp_path):
    out, port = tmp_path / "run", 29611
    procs = []
    for host in (0, 1):
        env = {**_env(), "GLOO_SOCKET_IFNAME": two_hosts.links[host]}  # gloo's pairs over the veth, not loopback
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{two_hosts.addrs[0]}:{port}", "--rdzv-id",
                    "two-hosts",
                    "--local-addr", two_hosts.addrs[host], "--max-restarts", "0",
                    str(RUN_PY), str(TINY_HUMANLINE), *OVERRIDES, f"output_dir={out}"]
        procs.append(subprocess.Popen(two_hosts.command(host, torchrun), cwd=REPO, env=env, stdout=subprocess.PIPE,
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


@pytest.fixture(scope="module")
def two_host_slurm(two_hosts):
    """slurmctld on host A and a slurmd per host, each under its host name and in its namespace; stopped after."""
    bins = ensure_slurm_installed()
    cluster = LocalSlurm(bins, list(zip(two_hosts.hostnames, two_hosts.addrs)), 6817, 6818, _env(), two_hosts.command)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        left = two_hosts.leftover_pids()
        assert not left, f"processes left in the namespaces after SLURM stopped: {left}"  # close() kills them


def test_slurm_steps_run_on_their_own_host(two_host_slurm, two_hosts):
    """Each slurmd's steps inherit its namespace and host name; one munged serves both (a credential made on
    host B through the socket file decodes on host A)."""
    step = two_host_slurm.run("srun", "--nodes=2", "--ntasks-per-node=1", "--label", "sh", "-c",
                              'echo "$(hostname) $(hostname -I) $SLURM_NODEID"')
    assert step.returncode == 0, step.stderr + two_host_slurm.logs()
    lines = sorted(line.split(": ", 1)[1].split() for line in step.stdout.strip().splitlines())
    assert lines == [[two_hosts.hostnames[i], two_hosts.addrs[i], str(i)] for i in (0, 1)], step.stdout
    socket_file = str(two_host_slurm.root / "munge.socket.2")
    made = subprocess.run(two_hosts.command(1, ["munge", "--socket", socket_file, "--string", "from-b"]),
                          capture_output=True, text=True)
    read = subprocess.run(two_hosts.command(0, ["unmunge", "--socket", socket_file]), input=made.stdout,
                          capture_output=True, text=True)
    assert made.returncode == 0 and read.returncode == 0 and read.stdout.rstrip().endswith("from-b"), (made, read)


def test_slurm_job_across_two_hosts_matches_one_host(two_host_slurm, two_hosts, one_host_metrics, tmp_path):
    out = tmp_path / "run"
    submit = [sys.executable, str(SLURM_PY), str(TINY_HUMANLINE), "--nodes", "2", "--gpus-per-node", "1", "--cpu",
              *OVERRIDES, f"output_dir={out}"]
    proc = subprocess.run(two_host_slurm.client(submit), cwd=REPO, env=two_host_slurm.env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    job = two_host_slurm.wait_done(job_id, timeout=300)
    log = "\n".join(p.read_text(errors="replace") for p in sorted((out / "slurm").glob("*.out")))
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, log, two_host_slurm.logs())
    node_a, node_b = two_hosts.hostnames
    assert job["NodeList"] == f"{node_a},{node_b}" and job["BatchHost"] == node_a, job
    assert f"2 node(s) x 1 rank(s), rendezvous {node_a}:" in log, log
    # the job's one step (srun: a torchrun per node) was launched by each host's slurmd, from the batch on host A
    for node in (node_a, node_b):
        slurmd_log = (two_host_slurm.root / f"slurmd-{node}.log").read_text()
        launched = rf"launch task StepId={job_id}\.0 request .* HOST:{re.escape(two_hosts.addrs[0])} "
        assert re.search(launched, slurmd_log), slurmd_log
    got = _metrics(out)
    assert [r["step"] for r in got] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in got)
    assert_same_rows(one_host_metrics, got, "SLURM on two hosts vs one host", tol=1e-6)
