"""A throwaway SLURM for the live tests (``/work/shared/docs/local-slurm.md``): Debian's munged, slurmctld and one
slurmd per node, started by hand as root (no systemd) in a temporary directory, each a foreground child of the
test, and stopped with everything they started by ``stop``. The controller runs on the first node. ``in_host``
wraps a command to run on node ``i`` (identity for one host on loopback; a network namespace in
``test_two_hosts.py``); client commands (``sbatch``, ``scontrol``...) go through ``client``, on the first node."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Tuple

from capabilities import missing as missing_capability

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun", "scancel", "sinfo")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def ensure_slurm_installed() -> dict:
    """``{binary: path}``; installs Debian's ``slurm-wlm munge`` when root and missing; else skips with the reason
    (a local run) or fails (``CI=true``)."""
    search = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing = [b for b in BINARIES if shutil.which(b, path=search) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"]
        if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
            subprocess.run(install, env=env, capture_output=True, timeout=600)
        missing = [b for b in BINARIES if shutil.which(b, path=search) is None]
    if missing:
        missing_capability("the SLURM daemons", f"{', '.join(missing)} not installed and could not be installed "
                           "(needs root and `apt-get install slurm-wlm munge`)")
    if os.geteuid() != 0:
        missing_capability("the SLURM daemons", "the local SLURM test starts slurmd/slurmctld as root "
                           "(SlurmUser=root); not root here")
    return {b: shutil.which(b, path=search) for b in BINARIES}


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def slurm_conf(root: Path, nodes: Sequence[Tuple[str, str]], cpus: int, ctld_port: int, slurmd_port: int) -> str:
    """slurm.conf for ``nodes`` (``(name, address)``; the first also runs slurmctld), everything under ``root``.
    Per-node paths use ``%n`` (the node name), so several slurmd share one file system."""
    names = ",".join(name for name, _ in nodes)
    return f"""ClusterName=hltest
SlurmctldHost={nodes[0][0]}({nodes[0][1]})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket.2,cred_expire=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=bf_interval=2,sched_interval=2,batch_sched_delay=0
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
""" + "".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} State=UNKNOWN\n" for name, addr in nodes) + (
        f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP\n")


class LocalSlurm:
    """munged + slurmctld (on node 0) + one ``slurmd -N <name>`` per node; ``start`` waits until every node is idle."""

    def __init__(self, bins: dict, nodes: Sequence[Tuple[str, str]], ctld_port: int, slurmd_port: int,
                 env: Optional[dict] = None, in_host: Callable[[int, list], list] = lambda host, argv: argv):
        self.bins, self.nodes, self.in_host = bins, list(nodes), in_host
        self.root = Path(tempfile.mkdtemp(prefix="hl-slurm-"))
        self.root.chmod(0o755)  # munged refuses a socket directory that is not 755
        self.conf = self.root / "slurm.conf"
        self.conf.write_text(slurm_conf(self.root, self.nodes, os.cpu_count() or 1, ctld_port, slurmd_port))
        self.env = dict(env if env is not None else os.environ, SLURM_CONF=str(self.conf))
        self.env.pop("SLURM_JOB_ID", None)
        self.daemons = []

    def _daemon(self, argv: list) -> None:
        self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                             start_new_session=True))

    def start(self) -> "LocalSlurm":
        root = self.root
        (root / "state").mkdir()
        subprocess.run([self.bins["mungekey"], "--create", f"--keyfile={root}/munge.key"], check=True,
                       capture_output=True)
        # one munged for every node: its socket is a path on the shared file system, reachable from any namespace
        self._daemon([self.bins["munged"], "--foreground", f"--key-file={root}/munge.key",
                      f"--socket={root}/munge.socket.2", f"--pid-file={root}/munged.pid",
                      f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"])
        wait_for(lambda: (root / "munge.socket.2").exists(), 10, "munged's socket")
        self._daemon(self.in_host(0, [self.bins["slurmctld"], "-D", "-f", str(self.conf)]))
        for host, (name, _) in enumerate(self.nodes):
            (root / f"spool-{name}").mkdir()
            self._daemon(self.in_host(host, [self.bins["slurmd"], "-D", "-N", name, "-f", str(self.conf)]))

        def idle():
            proc = self.run("sinfo", "-h", "-N", "-o", "%T")
            return proc.returncode == 0 and proc.stdout.split().count("idle") == len(self.nodes)

        try:
            wait_for(idle, 30, f"the local SLURM's {len(self.nodes)} node(s) to be idle")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None
        return self

    def client(self, argv: list) -> list:
        """``argv`` where the controller is reachable (the first node)."""
        return self.in_host(0, list(argv))

    def run(self, binary: str, *args) -> subprocess.CompletedProcess:
        return subprocess.run(self.client([self.bins[binary], *args]), env=self.env, capture_output=True, text=True)

    def job(self, job_id: str) -> dict:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", job_id).stdout))

    def wait_done(self, job_id: str, timeout: float = 150) -> dict:
        return wait_for(lambda: (lambda j: j if j.get("JobState") in FINAL_STATES else None)(self.job(job_id)),
                        timeout, f"job {job_id} to finish")

    def logs(self, tail: int = 1500) -> str:
        return "\n".join(f"== {log.name}\n{log.read_text(errors='replace')[-tail:]}"
                         for log in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """Cancel every job, then stop slurmd(s), slurmctld and munged (TERM, then KILL after 15 s), then the files."""
        if self.daemons:
            self.run("scancel", "--user", "root")
            try:  # a cancelled job's steps end before their slurmd does
                wait_for(lambda: not self.run("squeue", "-h").stdout.strip(), 10, "the cancelled jobs to end")
            except AssertionError:
                pass  # stopped below regardless
        for proc in reversed(self.daemons):
            proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 15
        for proc in reversed(self.daemons):
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
