"""launchers/slurm.py --container: the scripts rendered for pyxis/enroot and Apptainer parse (`bash -n`), mount every
path the recipe reads or writes (recipe and defaults files, model, data, output_dir, the Hugging Face cache), run the
image's code unless `--use-checkout`; image references in forms the runtimes do not take, and a recipe whose
output_dir is outside every mount, are refused (exit 2) before anything is submitted."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from hl_core.errors import UserError  # noqa: E402
from launchers import slurm  # noqa: E402
from launchers.containers import IMAGE_HOME, parse_image  # noqa: E402

SLURM_PY = REPO / "launchers" / "slurm.py"


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """A recipe, its defaults, model, data, output_dir, HF cache and working directory in six separate trees, none
    inside the checkout."""
    roots = {name: tmp_path / name for name in ("recipes", "models", "data", "scratch", "hf", "work", "images")}
    shutil.copytree(REPO / "recipes" / "tiny", roots["recipes"] / "tiny")
    shutil.copytree(REPO / "recipes" / "_base", roots["recipes"] / "_base")
    shutil.copytree(REPO / "tests" / "fixtures" / "tiny" / "model", roots["models"] / "tiny")
    shutil.copytree(REPO / "tests" / "fixtures" / "tiny" / "prefs", roots["data"] / "prefs")
    for name in ("scratch", "hf", "work", "images"):
        roots[name].mkdir()
    (roots["images"] / "humanline.sif").write_bytes(b"")
    (roots["images"] / "humanline.sqsh").write_bytes(b"")
    monkeypatch.setenv("HF_HOME", str(roots["hf"]))
    monkeypatch.chdir(roots["work"])
    overrides = [f"model.name_or_path={roots['models'] / 'tiny'}",
                 f"data.train.path={roots['data'] / 'prefs/train.jsonl'}",
                 f"data.eval.path={roots['data'] / 'prefs/eval.jsonl'}", f"output_dir={roots['scratch'] / 'run'}"]
    # what the job reads and writes, written out here (not asked of the launcher)
    touched = [roots["recipes"] / "tiny" / "humanline_dpo.yaml", roots["recipes"] / "_base" / "dpo.yaml",
               roots["recipes"] / "_base" / "humanline.yaml", roots["recipes"] / "tiny" / "_tiny.yaml",
               roots["models"] / "tiny" / "config.json", roots["data"] / "prefs" / "train.jsonl",
               roots["data"] / "prefs" / "eval.jsonl", roots["scratch"] / "run" / "checkpoints", roots["hf"] / "hub",
               roots["work"]]
    return roots, overrides, touched


def _render(roots, overrides, **kwargs):
    return slurm.render_sbatch(roots["recipes"] / "tiny" / "humanline_dpo.yaml", overrides, workdir=str(roots["work"]),
                               **kwargs)


def _srun_words(script: str):
    """The srun command (continuation lines joined) as shell words."""
    text = script[script.index("\n( srun ") + 3:].split('; echo "$?" > "$RC_FILE" ) &\n', 1)[0]
    return shlex.split(text.replace("\\\n", " "))


def _mounts(script: str):
    words = _srun_words(script)
    for word in words:
        if word.startswith("--container-mounts="):
            pairs = [m.split(":") for m in word.split("=", 1)[1].split(",")]
            assert all(src == dst for src, dst in pairs), pairs  # the same path inside as outside
            return [Path(src) for src, _ in pairs]
    return [Path(p) for p in words[words.index("--bind") + 1].split(",")]


def _assignment(script: str, name: str) -> str:
    line = next(line for line in script.splitlines() if line.startswith(f"{name}="))
    return shlex.split(line.split("=", 1)[1])[0]


def _covered(path: Path, mounts) -> bool:
    return any(path == m or m in path.parents for m in mounts)


@pytest.mark.parametrize("form", ["pyxis", "pyxis_sqsh", "apptainer"])
def test_scripts_parse_and_mount_every_path_the_recipe_touches(layout, tmp_path, form):
    roots, overrides, touched = layout
    image = {"pyxis": "nvcr.io#acme/humanline:0.1", "pyxis_sqsh": str(roots["images"] / "humanline.sqsh"),
             "apptainer": str(roots["images"] / "humanline.sif")}[form]
    script = _render(roots, overrides, container=image, nodes=2, gpus_per_node=4)
    path = tmp_path / "job.sh"
    path.write_text(script)
    parsed = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr

    mounts = _mounts(script)
    assert [p for p in touched if not _covered(p, mounts)] == [], mounts
    assert not _covered(REPO / "launchers" / "run.py", mounts)  # the image's code runs, not the checkout's
    assert _assignment(script, "RUN_PY") == f"{IMAGE_HOME}/launchers/run.py"
    assert f"export HF_HOME={roots['hf']}" in script
    words = _srun_words(script)
    if form == "apptainer":
        at = words.index("exec")
        assert words[at - 1:at + 2] == ["apptainer", "exec", "--nv"] and image in words
        assert words[words.index("--pwd") + 1] == str(roots["work"])
    else:
        assert f"--container-image={image}" in words and f"--container-workdir={roots['work']}" in words
        assert words[words.index("python"):words.index("python") + 3] == ["python", "-m", "torch.distributed.run"]


def test_use_checkout_mounts_and_runs_the_checkout(layout):
    roots, overrides, _ = layout
    script = _render(roots, overrides, container="nvcr.io#acme/humanline:0.1", use_checkout=True)
    assert _covered(REPO / "launchers" / "run.py", _mounts(script))
    assert _assignment(script, "RUN_PY") == str(REPO / "launchers" / "run.py")


def test_explicit_mounts_replace_the_per_path_mounts_and_must_cover_the_recipe(layout):
    roots, overrides, touched = layout
    shared = [str(roots[n]) for n in ("recipes", "models", "data", "scratch")]
    mounts = _mounts(_render(roots, overrides, container="nvcr.io#acme/humanline:0.1", mounts=shared))
    assert sorted(mounts) == sorted(Path(p) for p in shared + [str(roots["hf"]), str(roots["work"])])
    with pytest.raises(UserError) as err:  # the data directory is not mounted
        _render(roots, overrides, container="nvcr.io#acme/humanline:0.1", mounts=shared[:2] + shared[3:])
    assert "data.train.path" in str(err.value) and "--mount" in str(err.value)


def _stub_sbatch(tmp_path) -> dict:
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "sbatch").write_text(f"#!/usr/bin/env bash\necho \"$@\" >> {tmp_path / 'sbatch.calls'}\necho 1\n")
    (stubs / "sbatch").chmod(0o755)
    return dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", PYTHONPATH=str(REPO))


@pytest.mark.parametrize("dry_run", [True, False])
def test_output_dir_outside_every_mount_is_refused_before_submission(layout, tmp_path, dry_run):
    roots, overrides, _ = layout
    args = [sys.executable, str(SLURM_PY), str(roots["recipes"] / "tiny" / "humanline_dpo.yaml"), *overrides,
            "--container", "nvcr.io#acme/humanline:0.1",
            *[f"--mount={roots[n]}" for n in ("recipes", "models", "data")]]
    proc = subprocess.run(args + (["--dry-run"] if dry_run else []), cwd=roots["work"], env=_stub_sbatch(tmp_path),
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert "`output_dir`" in proc.stderr and str(roots["scratch"] / "run") in proc.stderr and "lost" in proc.stderr
    assert "Fix:" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    assert not (tmp_path / "sbatch.calls").exists() and not (roots["scratch"] / "run").exists()


def test_the_same_command_with_output_dir_mounted_is_submitted(layout, tmp_path):
    roots, overrides, _ = layout
    args = [sys.executable, str(SLURM_PY), str(roots["recipes"] / "tiny" / "humanline_dpo.yaml"), *overrides,
            "--container", "nvcr.io#acme/humanline:0.1",
            *[f"--mount={roots[n]}" for n in ("recipes", "models", "data", "scratch")]]
    proc = subprocess.run(args, cwd=roots["work"], env=_stub_sbatch(tmp_path), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "sbatch.calls").read_text().count("--parsable") == 1


@pytest.mark.parametrize("ref,runtime", [
    ("nvcr.io#acme/humanline:0.1", "pyxis"),
    ("alice@registry.example:5000#team/humanline:0.1", "pyxis"),
    ("humanline:0.1", "pyxis"),  # Docker Hub
    ("docker://nvcr.io/acme/humanline:0.1", "apptainer"),
    ("oras://registry.example/humanline:0.1", "apptainer"),
])
def test_image_references_each_runtime_takes(ref, runtime, tmp_path):
    assert parse_image(ref, tmp_path) == (parse_image(ref, tmp_path).__class__(runtime, ref))


@pytest.mark.parametrize("ref,needle", [
    ("nvcr.io/acme/humanline:0.1", "nvcr.io#acme/humanline:0.1"),
    ("localhost/humanline:ci", "localhost#humanline:ci"),
    ("Humanline 0.1", "[USER@][REGISTRY#]IMAGE[:TAG]"),
    ("podman://localhost/humanline:ci", "drop the scheme"),
    ("/images/humanline.tar", "neither a `.sif`"),
    ("/images/missing.sif", "does not exist"),
])
def test_image_references_the_runtimes_would_not_take_are_refused(layout, tmp_path, ref, needle):
    roots, overrides, _ = layout
    proc = subprocess.run([sys.executable, str(SLURM_PY), str(roots["recipes"] / "tiny" / "humanline_dpo.yaml"),
                           *overrides, "--container", ref, "--dry-run"], cwd=roots["work"], env=_stub_sbatch(tmp_path),
                          capture_output=True, text=True)
    assert proc.returncode == 2 and needle in proc.stderr and "Fix" in proc.stderr, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1


def test_a_mount_over_the_images_own_directories_is_refused(layout):
    roots, overrides, _ = layout
    with pytest.raises(UserError, match="over the image's own `/usr`"):
        _render(roots, overrides, container="nvcr.io#acme/humanline:0.1",
                mounts=[str(roots[n]) for n in ("recipes", "models", "data", "scratch")] + ["/usr"])


def test_mount_and_use_checkout_need_a_container(layout):
    roots, overrides, _ = layout
    with pytest.raises(UserError, match="container job only"):
        _render(roots, overrides, use_checkout=True)


def test_a_docker_hub_reference_is_accepted_with_a_note(layout, tmp_path):
    roots, overrides, _ = layout
    base = [sys.executable, str(SLURM_PY), str(roots["recipes"] / "tiny" / "humanline_dpo.yaml"), *overrides,
            "--dry-run"]
    env = _stub_sbatch(tmp_path)
    hub = subprocess.run(base + ["--container", "humanline:0.1"], cwd=roots["work"], env=env, capture_output=True,
                         text=True)
    assert hub.returncode == 0 and "pulls it from Docker Hub" in hub.stderr
    assert "--container-image=humanline:0.1" in hub.stdout
    registry = subprocess.run(base + ["--container", "nvcr.io#acme/humanline:0.1"], cwd=roots["work"], env=env,
                              capture_output=True, text=True)
    assert registry.returncode == 0 and "Docker Hub" not in registry.stderr
