"""What a newcomer copies runs as written (issue 52): every command block of the README and of the getting-started,
quickstart and examples pages is extracted here and either run (a long run as ``--validate``, a submission as
``--dry-run``) or named with the test or CI step that runs it; and the README's two install lines, in a fresh
virtual environment on a copy of the checkout, install what their demos need: the tiny demo trains, the real-model
demo's recipe validates (converting nothing), and the plot command either refuses in one paragraph (no matplotlib)
or writes its plots.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from helpers import REPO, run_here

PAGES = ["README.md", "docs/getting-started.md", "docs/quickstart.md", "docs/examples.md"]
# commands these pages show that another test or CI step runs, and which
ELSEWHERE = {
    "bash .ci/run": "CI itself (the README's test command)",
    "docker ": ".ci/container.sh builds the real Dockerfile with podman and trains in the image (no Docker engine "
               "runs on these machines)",
    "mkdocs serve": ".ci/docs.sh builds the same site with mkdocs --strict (serve would not return)",
    "pip install": "test_the_readme_installs_run_in_a_fresh_venv (the README's two install lines)",
    "python examples/torch_dpo.py": "tests/test_own_loop.py runs each own-loop example",
    "python examples/deepspeed_dpo.py": "tests/test_own_loop.py runs each own-loop example",
    "python examples/megatron_dpo.py": "tests/test_own_loop.py runs each own-loop example",
    "python examples/trl_dpo.py": "tests/test_trl_examples.py runs the TRL examples",
    "python examples/trl_grpo.py": "tests/test_trl_examples.py runs the TRL examples",
}
REAL_DEMO = "recipes/real/smollm2_addition_grpo.yaml"


def commands(text: str) -> list:
    """The command lines of ``text``'s ``bash`` blocks: continuations joined, comments and ``&&`` chains split."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+", " ", re.sub(r"(^|\s)#.*$", "", line)).strip()
            found += [part.strip() for part in line.split("&&") if part.strip()]
    return found


def runnable(command: str):
    """The argv that runs ``command`` here (``python launchers/run.py ... --validate`` for a run, ``--dry-run`` for
    a SLURM submission), or None where ``ELSEWHERE`` names what runs it. A command neither knows fails the test."""
    if any(command.startswith(prefix) or prefix in command for prefix in ELSEWHERE):
        return None
    argv = shlex.split(command)
    if argv[0] in ("deepspeed", "torchrun"):  # the launcher's own options dropped: one process validates
        argv = ["python", *argv[next(i for i, a in enumerate(argv) if a.endswith(".py")):]]
    if argv[:2] == ["python", "launchers/run.py"]:
        if "RECIPE.yaml" in argv:  # the pattern line: its concrete forms follow it
            return None
        checks = {"--validate", "--plan", "--print-config"}
        return [sys.executable, *argv[1:]] + ([] if checks & set(argv) else ["--validate"])
    if argv[:2] == ["python", "launchers/slurm.py"]:
        # an image file of the reader's own (`--container /images/x.sif`): not on this machine, so not checked here
        placeholder = ["--no-check"] if any(a.startswith("/images/") for a in argv) else []
        return [sys.executable, *argv[1:]] + ([] if "--dry-run" in argv else ["--dry-run"]) + placeholder
    raise AssertionError(f"no rule runs `{command}`: add one here or name its test in ELSEWHERE")


def test_the_command_rules_cover_the_forms_shown():
    assert commands("```bash\npip install -e . && deepspeed launchers/run.py R.yaml \\\n  a.b=1  # note\n```") == [
        "pip install -e .", "deepspeed launchers/run.py R.yaml a.b=1"]
    assert runnable("deepspeed --num_gpus 2 launchers/run.py r.yaml x=1")[1:] == ["launchers/run.py", "r.yaml", "x=1",
                                                                                  "--validate"]
    assert runnable("torchrun --nproc_per_node 2 launchers/run.py r.yaml")[-1] == "--validate"
    assert runnable("python launchers/run.py r.yaml --plan")[-1] == "--plan"
    assert runnable("python launchers/slurm.py r.yaml --container x")[-1] == "--dry-run"
    assert runnable("docker build -t x .") is None
    with pytest.raises(AssertionError, match="no rule runs `make everything`"):
        runnable("make everything")


def _run(argv) -> subprocess.CompletedProcess:
    """``python launchers/run.py|slurm.py ARGS`` run by the script's ``main()`` in this process, as its own process
    would run it (``helpers.run_here``: cwd at the repository, the process state restored afterwards)."""
    from launchers import run, slurm

    main = {"launchers/run.py": run.main, "launchers/slurm.py": slurm.main}[argv[1]]
    return run_here(argv[2:], lambda: main(argv[2:]))


@pytest.mark.parametrize("page", PAGES)
def test_every_command_shown_runs_as_written(page, tmp_path, monkeypatch):
    """Each command runs with its own arguments (a run validated, a submission dry-run), with no hub: exit 0."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HL_MODEL_CACHE", str(tmp_path / "model-cache"))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    ran = []
    for command in commands((REPO / page).read_text()):
        argv = runnable(command)
        if argv is None:
            continue
        proc = _run(argv)
        assert proc.returncode == 0, f"{page}: `{command}` exited {proc.returncode}:\n{proc.stdout[-2000:]}" \
                                     f"{proc.stderr[-3000:]}"
        ran.append(command)
    assert ran or page == "docs/examples.md", f"{page} shows no command this test runs"


def _readme_install_lines() -> tuple:
    """The README's tiny-demo line and its real-model lines, as a user copies them."""
    lines = commands((REPO / "README.md").read_text())
    first = next(c for c in lines if c.startswith("deepspeed launchers/run.py recipes/tiny/humanline_dpo.yaml"))
    block = re.search(r"```bash\n(pip install torch[^\n]*\[real\][^\n]*)\n(.*?)```", (REPO / "README.md").read_text(),
                      re.S)
    assert block, "the README's real-model block: its install line, then the demo's commands"
    return first, block.group(1), block.group(2).split("\n")


def _copy_of_the_checkout(root: Path) -> Path:
    copy = root / "checkout"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(".git", "build", "runs", "__pycache__", "*.egg-info",
                                                               ".ruff_cache", ".benchmarks"))
    return copy


def _sh(line: str, cwd: Path, env: dict, timeout: int = 1200) -> subprocess.CompletedProcess:
    """``line`` as a user's shell runs it (bash, the venv first on PATH)."""
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def test_the_readme_installs_run_in_a_fresh_venv(tmp_path):
    """A fresh virtual environment on a copy of the checkout: the README's first command installs and runs the tiny
    demo; its plot command then refuses in one paragraph (matplotlib is not in that install); the real-model install
    line adds what the second demo needs, whose recipe then validates without converting the model, and the plot
    command writes the plots."""
    first, real_install, real_runs = _readme_install_lines()
    checkout = _copy_of_the_checkout(tmp_path)
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{env_dir / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(env_dir),
               HF_HUB_OFFLINE="1", HL_MODEL_CACHE=str(tmp_path / "model-cache"), PIP_DISABLE_PIP_VERSION_CHECK="1",
               OMP_NUM_THREADS="1")
    env.pop("CI", None)  # the user's shell

    demo = _sh(f"pip install -q torch==2.13.0 && pip install -q -e . && {first}", checkout, env)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-5000:]
    plot = next(line for line in demo.stdout.splitlines() if line.startswith("plot: ")).removeprefix("plot: ")
    refused = _sh(plot, checkout, env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert refused.stderr.strip().count("\n") == 0 and "matplotlib" in refused.stderr and "[eval]" in refused.stderr

    installed = _sh(real_install, checkout, env)
    assert installed.returncode == 0, installed.stderr[-5000:]
    validate = next(line for line in real_runs if line.strip().endswith(f"{REAL_DEMO} --validate"))
    checked = _sh(validate, checkout, env)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-5000:]
    assert not list((tmp_path / "model-cache").glob("**/config.json")), "--validate converted the model"
    drawn = _sh(plot, checkout, env)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    assert (checkout / "runs" / "tiny_humanline_dpo" / "report" / "loss.png").stat().st_size > 1000
