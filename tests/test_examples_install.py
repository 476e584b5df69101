"""The examples run from the install they name (issue 47): each one's docstring and docs/examples.md name its extra;
run without it (its modules hidden from a real subprocess by a `sitecustomize` import blocker, not a mock of the
guard) it prints one paragraph with the install command and exits 2; and the DeepSpeed example's two CPU processes
compile nothing from an empty extension cache with no working compiler on the PATH."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

EXAMPLES = REPO / "examples"
EXTRAS = {"megatron_dpo.py": ("megatron", "megatron"), "trl_dpo.py": ("trl", "trl"), "trl_grpo.py": ("trl", "trl")}
BLOCKER = '''import sys
BLOCKED = {blocked!r}


class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Blocker())
'''


def _run(script, tmp_path, blocked=(), env=None, args=(), timeout=300):
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(BLOCKER.format(blocked=tuple(blocked)))
    path = os.pathsep.join([str(shim), str(REPO), os.environ.get("PYTHONPATH", "")])
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # not under a launcher
        full_env.pop(key, None)
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("script", sorted(EXTRAS))
def test_an_example_without_its_extra_names_the_install_and_exits_2(script, tmp_path):
    extra, module = EXTRAS[script]
    proc = _run(script, tmp_path, blocked=[module])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    paragraph = proc.stderr.strip()
    assert "\n" not in paragraph, paragraph  # one paragraph
    assert f'pip install -e ".[{extra}]"' in paragraph and f"`{extra}` extra" in paragraph and script in paragraph


def test_the_blocker_really_hides_the_module(tmp_path):
    """The shim is what the test above relies on: with it, importing the module fails in the child."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(BLOCKER.format(blocked=("megatron",)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)])}
    proc = subprocess.run([sys.executable, "-c", "import megatron.core"], env=env, capture_output=True, text=True)
    assert proc.returncode == 1 and "ModuleNotFoundError: No module named 'megatron" in proc.stderr


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")))
def test_every_example_names_its_install_in_its_docstring_and_page(script):
    text = (EXAMPLES / script).read_text()
    doc = text[:text.index('"""', 3)]
    page = (REPO / "docs" / "examples.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith(f"| `examples/{script}`"))
    extra = EXTRAS.get(script, (None,))[0]
    if extra:
        assert f'pip install -e ".[{extra}]"' in doc and f'pip install -e ".[{extra}]"' in row
        assert re.search(rf'require_extra\("{extra}"', text[:text.index("\nimport ") if "\nimport " in text else None])
    else:
        assert "pip install -e ." in doc and "`pip install -e .`" in row


def test_the_deepspeed_example_on_two_cpu_processes_compiles_nothing(tmp_path):
    """A first run in an empty TORCH_EXTENSIONS_DIR with a compiler that always fails first on the PATH: it trains
    (2 processes, ZeRO-3) and DeepSpeed builds nothing (it would JIT-compile `deepspeed_shm_comm` with g++)."""
    extensions, bin_dir = tmp_path / "extensions", tmp_path / "bin"
    bin_dir.mkdir()
    for compiler in ("g++", "c++", "gcc", "cc", "ninja"):
        (bin_dir / compiler).write_text("#!/bin/sh\necho no compiler here >&2\nexit 1\n")
        (bin_dir / compiler).chmod(0o755)
    env = {"TORCH_EXTENSIONS_DIR": str(extensions), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "CXX": str(bin_dir / "g++")}
    proc = _run("deepspeed_dpo.py", tmp_path, env=env, args=["--steps", "2"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert re.findall(r"^update (\d+) ", proc.stdout, re.M) == ["0", "1"], proc.stdout[-2000:]
    assert "built successfully" not in proc.stdout + proc.stderr and "no compiler here" not in proc.stderr
    assert not extensions.exists() or not any(extensions.rglob("*.so")), list(extensions.rglob("*"))
