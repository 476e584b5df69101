"""SLURM jobs in a container: which runtime an image reference is for, what to mount, and the launch command.

Two runtimes, told apart by the reference (``--container`` / ``cluster.container``):

* **pyxis/enroot** (``srun --container-image``): enroot's ``[USER@][REGISTRY#]IMAGE[:TAG]``, e.g.
  ``nvcr.io#acme/humanline:0.1`` (a registry is separated by ``#``, not ``/``), or a squashfs file
  (``/images/humanline.sqsh``, from ``enroot import``).
* **Apptainer** (``apptainer exec``): a ``.sif`` file, or a ``docker://``, ``oras://`` or ``library://`` URI.

A reference in neither form is refused (``UserError``), e.g. ``nvcr.io/acme/humanline:0.1``, which enroot would look
up on Docker Hub as the user ``nvcr.io``.

Mounts (same path inside as outside): the job's working directory, the directories of the recipe file and its
``defaults:``, every local path the resolved recipe names (model, tokenizer, data, reward model, checkpoint),
``output_dir`` and the Hugging Face cache (``HF_HOME``); nested ones are folded into their parent. With explicit
``--mount DIR`` the per-path mounts are replaced by those directories, and a recipe path outside every mount is
refused before submission: a run whose ``output_dir`` is not mounted would write its checkpoints inside the
container, and lose them when the job ends.

The job runs the image's own code (``IMAGE_HOME/launchers/run.py``) unless ``use_checkout`` is set; then the checkout
is mounted and its ``launchers/run.py`` runs on the image's Python environment.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import yaml

from hl_core.errors import UserError

IMAGE_HOME = "/workspace/humanline"  # the Dockerfile's WORKDIR and HL_HOME: where the image keeps this package
APPTAINER_SCHEMES = ("docker://", "oras://", "library://")
SQUASHFS_SUFFIXES = (".sqsh", ".squashfs", ".sqfs")
# enroot: [USER@][REGISTRY#]IMAGE[:TAG]; IMAGE is Docker's lower-case path grammar.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_ENROOT = re.compile(
    rf"(?:(?P<user>[A-Za-z0-9_.-]+)@)?(?:(?P<registry>[A-Za-z0-9.-]+(?::[0-9]+)?)#)?"
    rf"(?P<image>{_COMPONENT}(?:/{_COMPONENT})*)(?::(?P<tag>[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}}))?"
)
# Paths a bind mount must not cover: the container's own system, and the image's copy of this package.
_SYSTEM = ("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/opt", "/opt/venv", "/proc", "/run", "/sbin",
           "/sys", "/usr", "/var", "/workspace", IMAGE_HOME)


@dataclass(frozen=True)
class Image:
    runtime: str  # "pyxis" or "apptainer"
    ref: str  # as passed to the runtime (files made absolute)


def _grammar_help(ref: str) -> str:
    return (
        f"`--container {ref}` (or `cluster.container`) is not an image reference pyxis or Apptainer takes. "
        "pyxis/enroot takes `[USER@][REGISTRY#]IMAGE[:TAG]` (the registry ends with `#`: `nvcr.io#acme/humanline:0.1`; "
        "no registry means Docker Hub) or the absolute path of a squashfs file (`/images/humanline.sqsh`, made by "
        "`enroot import -o humanline.sqsh docker://REGISTRY#IMAGE:TAG`); Apptainer takes a `.sif` file or a "
        "`docker://`, `oras://` or `library://` URI."
    )


def parse_image(ref: str, workdir: Path, check_files: bool = True) -> Image:
    """The runtime ``ref`` is for, and the reference to pass it; ``UserError`` for a form neither runtime takes."""
    text = ref.strip()
    if not text or text != ref:
        raise UserError(_grammar_help(ref) + " Fix: give the reference without surrounding spaces.")
    if text.startswith(APPTAINER_SCHEMES):
        if not re.fullmatch(r"[a-z]+://[A-Za-z0-9_./:@#-]+", text):
            raise UserError(_grammar_help(ref) + " Fix: e.g. `docker://nvcr.io/acme/humanline:0.1`.")
        return Image("apptainer", text)
    if "://" in text:
        raise UserError(_grammar_help(ref) + " Fix: drop the scheme for pyxis (`nvcr.io#acme/humanline:0.1`), or use "
                        "`docker://` with Apptainer.")
    is_file = text.endswith((".sif",) + SQUASHFS_SUFFIXES) or text.startswith(("/", "./", "../"))
    if is_file:
        path = Path(text) if Path(text).is_absolute() else workdir / text
        path = Path(os.path.normpath(path))
        if not path.name.endswith((".sif",) + SQUASHFS_SUFFIXES):
            raise UserError(_grammar_help(ref) + f" `{path}` is a path but neither a `.sif` (Apptainer) nor a "
                            "`.sqsh` squashfs file (pyxis). Fix: convert the image, e.g. "
                            "`apptainer build humanline.sif docker-archive://humanline.tar`.")
        if check_files and not path.is_file():
            raise UserError(f"The container image file `{path}` (`--container {ref}`) does not exist. Fix: build or "
                            "copy it there (a path every node can read), or pass `--no-check` when it exists only on "
                            "the compute nodes.")
        return Image("apptainer" if path.name.endswith(".sif") else "pyxis", str(path))
    match = _ENROOT.fullmatch(text)
    if not match:
        raise UserError(_grammar_help(ref) + " Fix: e.g. `nvcr.io#acme/humanline:0.1` or `/images/humanline.sqsh`.")
    first = match.group("image").split("/")[0]
    if match.group("registry") is None and "/" in match.group("image") and ("." in first or first == "localhost"):
        fixed = text.replace("/", "#", 1)
        raise UserError(
            f"`--container {ref}` (or `cluster.container`) names the registry `{first}` with a `/`: pyxis/enroot would "
            f"look `{match.group('image')}` up on Docker Hub, with `{first}` as a Docker Hub user, and fail. enroot "
            f"separates the registry with `#`. Fix: `--container {fixed}`, or import the image once "
            f"(`enroot import -o humanline.sqsh docker://{fixed}`) and pass the `.sqsh` file."
        )
    return Image("pyxis", text)


def image_notes(image: Image) -> List[str]:
    """Notes worth printing at submission for an accepted reference (not errors)."""
    if image.runtime == "pyxis" and not image.ref.startswith("/") and "#" not in image.ref:
        return [f"note: `--container {image.ref}` names no registry, so pyxis/enroot pulls it from Docker Hub on every "
                "node. For an image of your own registry write `REGISTRY#IMAGE:TAG`, or import it once into a `.sqsh` "
                "file (`enroot import`) and pass that path."]
    return []


def hf_cache_dir(env: Optional[Dict[str, str]] = None) -> Path:
    """The Hugging Face cache the job should use: ``HF_HOME``, else ``$XDG_CACHE_HOME/huggingface``, else
    ``~/.cache/huggingface`` (huggingface_hub's own order)."""
    env = os.environ if env is None else env
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser().resolve()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return (Path(base).expanduser() / "huggingface").resolve()


def recipe_files(recipe_path: Path) -> List[Path]:
    """The recipe file and every file its ``defaults:`` chain reads (already validated by ``load_recipe``)."""
    seen, queue = [], [recipe_path.resolve()]
    while queue:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.append(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            continue
        bases = data.get("defaults") if isinstance(data, dict) else None
        for base in bases if isinstance(bases, list) else []:
            if isinstance(base, str):
                queue.append((path.parent / base).resolve())
    return seen


def _strings(value, key: str = "") -> Iterable[Tuple[str, str]]:
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _strings(item, f"{key}.{name}" if key else str(name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _strings(item, f"{key}[{i}]")
    elif isinstance(value, str):
        yield key, value


def recipe_paths(recipe, recipe_path: Path, workdir: Path) -> List[Tuple[str, Path, str]]:
    """``(what, path, mode)`` for everything the job reads (``r``) or writes (``w``) outside the image.

    Reads: the recipe and its ``defaults:`` files, and every string of the resolved recipe that names an existing
    local file or directory (relative ones from ``workdir``, as the run resolves them): model, tokenizer, data
    files, reward model, a checkpoint to resume. Writes: ``output_dir``.
    """
    found = [(f"the recipe file `{p.name}`" if i == 0 else f"the recipe's defaults file `{p.name}`", p.parent, "r")
             for i, p in enumerate(recipe_files(recipe_path))]
    dumped = recipe.model_dump()
    out = dumped.pop("output_dir")
    for key, text in _strings(dumped):
        if not text or "\n" in text or len(text) > 4096:
            continue
        path = Path(text).expanduser()
        path = path if path.is_absolute() else workdir / path
        try:
            exists = path.exists()
        except OSError:
            continue
        if exists:
            resolved = path.resolve()
            found.append((f"`{key}`", resolved if resolved.is_dir() else resolved.parent, "r"))
    out_path = Path(out).expanduser()
    found.append(("`output_dir`", Path(os.path.normpath(out_path if out_path.is_absolute() else workdir / out_path)),
                  "w"))
    return found


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def fold(paths: Sequence[Path]) -> List[Path]:
    """Sorted, unique, and none inside another (a bind of the parent covers it)."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    kept: List[Path] = []
    for path in unique:
        if not any(_inside(path, k) for k in kept):
            kept.append(path)
    return sorted(kept)


@dataclass(frozen=True)
class ContainerPlan:
    image: Image
    mounts: Tuple[str, ...]
    run_py: str
    hf_home: str


def plan(image: Image, recipe, recipe_path: Path, workdir: Path, *, explicit_mounts: Sequence[str] = (),
         use_checkout: bool = False, checkout: Optional[Path] = None, env: Optional[Dict[str, str]] = None,
         check: bool = True) -> ContainerPlan:
    """What the job mounts and runs; ``UserError`` when a recipe path would be outside every mount, or a mount would
    cover the container's own system directories."""
    hf_home = hf_cache_dir(env)
    needed = recipe_paths(recipe, recipe_path, workdir)
    always = [("the working directory", workdir), ("the Hugging Face cache (`HF_HOME`)", hf_home)]
    if use_checkout:
        always.append(("the checkout (`--use-checkout`)", checkout))
    explicit = [Path(os.path.normpath(Path(m).expanduser().resolve())) for m in explicit_mounts]
    for given, path in zip(explicit_mounts, explicit):
        if check and not path.is_dir():
            raise UserError(f"`--mount {given}` is not a directory here (`{path}`): the container runtime can only "
                            "mount a directory that exists on the nodes. Fix: create it, correct the path, or pass "
                            "`--no-check` when it exists only on the compute nodes.")
    chosen = explicit + [p for _, p in always] if explicit else [p for _, p in always] + [p for _, p, _ in needed]
    mounts = fold(chosen)
    for what, path, mode in needed:
        if not any(_inside(path, m) for m in mounts):
            verb = "writes" if mode == "w" else "reads"
            consequence = (" would be written inside the container and lost when the job ends" if mode == "w"
                           else " would not be found in the container")
            raise UserError(
                f"{what[0].upper() + what[1:]}: the job {verb} `{path}`, which is outside every container mount "
                f"({', '.join(str(m) for m in mounts)}), so it{consequence}. Fix: add `--mount {path}` (or a "
                "directory above it on a file system every node shares), move the path under a mounted directory, "
                "or leave `--mount` out to mount each path the recipe names."
            )
    for mount in mounts:
        if str(mount) in _SYSTEM:
            source = next((w for w, p in always if p == mount), None) or next(
                (w for w, p, _ in needed if _inside(p, mount) or p == mount), f"`--mount {mount}`")
            raise UserError(
                f"The container would mount `{mount}` (for {source}) over the image's own `{mount}`, hiding its "
                f"Python environment or this package's code. Fix: keep recipes, data, models, `output_dir`, "
                "`HF_HOME` and the working directory in directories of their own (e.g. under /scratch or $HOME)."
            )
    run_py = str(checkout / "launchers" / "run.py") if use_checkout else f"{IMAGE_HOME}/launchers/run.py"
    return ContainerPlan(image, tuple(str(m) for m in mounts), run_py, str(hf_home))


def launch(cp: ContainerPlan, workdir: Path, python: Optional[str], cpu: bool) -> Tuple[str, str]:
    """``(extra srun options, launcher command)`` for the sbatch template (both already shell-quoted)."""
    py = shlex.quote(python or "python")
    if cp.image.runtime == "apptainer":
        words = ["apptainer exec", *([] if cpu else ["--nv"]), "--bind", shlex.quote(",".join(cp.mounts)),
                 "--pwd", shlex.quote(str(workdir)), shlex.quote(cp.image.ref), py]
        return "", " ".join(words)
    srun_extra = (
        f" \\\n  --container-image={shlex.quote(cp.image.ref)}"
        f" --container-mounts={shlex.quote(','.join(f'{m}:{m}' for m in cp.mounts))}"
        f" --container-workdir={shlex.quote(str(workdir))}"
    )
    return srun_extra, py
