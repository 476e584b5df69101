"""Loading tokenizers and causal-LM weights for the engines (Hugging Face formats)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..errors import RecipeError
from ..models.specs import resolve_spec
from ..storage import gguf_models
from .speed import apply_kernels, resolve_attention

# Imports inside functions: transformers (seconds to import) loads when a model or tokenizer is built, so --plan and
# --print-config, which import this package's neighbours, do not pay for it.

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_REHEARSAL_WEIGHTS = False  # see rehearsal_weights()


@contextlib.contextmanager
def rehearsal_weights():
    """Inside (``hl_core.rehearsal``): random-init weights are built the cheapest way that still gives every rank
    what a real run holds: directly in the compute dtype (no float32 copy of the whole model first), under ZeRO-3
    partitioned as they are created (DeepSpeed's ``zero.Init``, as a real ZeRO-3 run loads its checkpoint), and
    the megatron engine keeps the random shards its own initialisers drew instead of converting a whole Hugging
    Face model. Shapes, dtypes and placement are a real run's; the values are not those of an ordinary
    ``model.random_init`` run (a rehearsal's values are meaningless anyway)."""
    global _REHEARSAL_WEIGHTS
    _REHEARSAL_WEIGHTS = True
    try:
        yield
    finally:
        _REHEARSAL_WEIGHTS = False


def rehearsing_weights() -> bool:
    return _REHEARSAL_WEIGHTS


# Any of these in a directory means it holds a tokenizer (fast, sentencepiece or BPE files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def _remote_code_error(what: str, name: str) -> RecipeError:
    return RecipeError(
        f"The {what} at `{name}` comes with custom modelling code, which runs only with "
        "`model.trust_remote_code: true`. Fix: read that code, then set `model.trust_remote_code=true`, or use "
        "a model that transformers supports natively."
    )


def load_tokenizer(model_cfg):
    """The tokenizer of ``model.tokenizer`` (default ``model.name_or_path``), with a pad token; refused when
    it has more tokens than the model's vocabulary (see `check_vocab`)."""
    from transformers import AutoTokenizer

    model_cfg = gguf_models.resolve_model(model_cfg)  # a gguf: model: its converted directory (converted once)
    name = model_cfg.tokenizer or model_cfg.name_or_path
    key = "model.tokenizer" if model_cfg.tokenizer else "model.name_or_path"
    local = Path(name).expanduser()
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        raise RecipeError(
            f"`{key}: {name}` is a directory without tokenizer files (none of {', '.join(TOKENIZER_FILES)}). Fix: "
            "point `model.tokenizer` at the directory that holds the model's tokenizer."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code)
    except Exception as exc:  # a damaged tokenizer.json fails with KeyError, TypeError, tokenizers' bare Exception...
        if "trust_remote_code" in str(exc):
            raise _remote_code_error("tokenizer", name) from None
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else "no message"
        files = [f for f in TOKENIZER_FILES if (local / f).is_file()] if local.is_dir() else []
        where = f" (its files: {', '.join(files)})" if files else ""
        raise RecipeError(
            f"Could not load the tokenizer from `{key}` = `{name}`{where}: {type(exc).__name__}: {first}. "
            "Fix: point it at a local directory with intact tokenizer files (e.g. the model's own tokenizer.json), or "
            "a Hugging Face name reachable from this machine."
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    check_vocab(model_cfg, tokenizer)
    return tokenizer


def check_vocab(model_cfg, tokenizer) -> None:
    """The model's vocabulary (config.json, with ``model.config_overrides``) holds every token id of the
    tokenizer; a model whose size is unknown here (no config.json at hand) is not checked."""
    try:
        vocab = resolve_spec(model_cfg).vocab_size
    except RecipeError:
        return
    if len(tokenizer) > vocab:
        overridden = "vocab_size" in (model_cfg.config_overrides or {})
        key = "model.config_overrides.vocab_size" if overridden else "model.tokenizer` / `model.name_or_path"
        raise RecipeError(
            f"The model's vocabulary ({vocab} tokens) is smaller than the tokenizer's ({len(tokenizer)}), so token "
            f"ids >= {vocab} have no embedding (`{key}`). Fix: "
            + (f"set `model.config_overrides.vocab_size` to at least {len(tokenizer)}, or remove it."
               if overridden else "use the tokenizer that belongs to the model.")
        )


def check_model_config(model_cfg) -> None:
    """For a local model directory: its config builds with ``model.config_overrides`` and needs no custom code
    unless ``model.trust_remote_code`` is set (reads config.json only: no weights, no custom code run)."""
    from transformers import AutoConfig

    local = Path(model_cfg.name_or_path).expanduser()
    if not local.is_dir() or model_cfg.trust_remote_code:
        return
    try:
        AutoConfig.from_pretrained(str(local), trust_remote_code=False, **model_cfg.config_overrides)
    except (OSError, ValueError, TypeError) as exc:
        if "trust_remote_code" in str(exc):
            raise _remote_code_error("model", model_cfg.name_or_path) from None
        raise RecipeError(
            f"`model.name_or_path: {model_cfg.name_or_path}`: its config.json does not load with "
            f"`model.config_overrides` {model_cfg.config_overrides} ({str(exc).strip().splitlines()[0]}). "
            "Fix: repair config.json or the overrides."
        ) from None


SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library refuses longer headers


def safetensors_problem(path: Path) -> Optional[str]:
    """What is wrong with the safetensors file ``path`` (None when nothing is): its 8-byte header length, the
    JSON header, and every tensor's byte span inside the file (a cut file leaves spans past its end). Reads the
    header only."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            return f"it has {size} bytes, fewer than the 8 of a safetensors header length"
        length = int.from_bytes(prefix, "little")
        if length > min(SAFETENSORS_MAX_HEADER, size - 8):
            return f"its header claims {length:,} bytes, more than the file ({size:,} bytes) or safetensors allow"
        raw = fh.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "its header is not JSON text (NUL or other bytes)"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    data = size - 8 - length
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            return f"its header entry `{name}` has no valid `data_offsets`"
        if offsets[1] > data:
            return (f"tensor `{name}` ends at byte {offsets[1]:,} of a data section of {data:,} bytes: the file is "
                    "cut short")
        end = max(end, offsets[1])
    if end != data:
        return f"its tensors cover {end:,} of its {data:,} data bytes"
    return None


def weight_files_problem(directory) -> Optional[str]:
    """What keeps the local model directory ``directory`` from loading, checked without reading weights: no
    ``config.json``, a damaged ``*.safetensors`` file (`safetensors_problem`), or a shard its index names
    that is missing. None when nothing is found."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        return f"`{directory}` has no config.json, so it is not a Hugging Face model directory"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return f"`{index}` is not a safetensors index (a JSON object with a `weight_map`)"
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            return f"`{index}` names {len(missing)} shard(s) that are missing, e.g. `{missing[0]}`"
    for path in sorted(directory.glob("*.safetensors")):
        problem = safetensors_problem(path)
        if problem is not None:
            return f"`{path}` is damaged: {problem}"
    if not any(directory.glob("*.safetensors")):  # transformers loads the pickled weights only then
        for path in sorted(directory.glob("pytorch_model*.bin")):
            problem = pickle_problem(path)
            if problem is not None:
                return f"`{path}` {problem}"
    return None


def pickle_problem(path: Path) -> Optional[str]:
    """What keeps the pickled weight file ``path`` from a ``weights_only`` load, found without running any of it:
    the globals its pickle names beyond the tensors and containers ``torch.load(weights_only=True)`` allows (e.g.
    ``posix.system``: code), or a file that is not a ``torch.save`` archive and does not load as weights."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except (ValueError, RuntimeError, OSError):  # not a zip archive: the legacy format, or not torch's at all
        unsafe = None
    if unsafe is None:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=False)  # never runs the pickle's code
        except Exception as exc:  # noqa: BLE001 (any failure means it does not load as weights)
            return f"does not load as weights only ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        return None
    if unsafe:
        shown = ", ".join(f"`{name}`" for name in unsafe[:3])
        return (f"is a pickle that names {shown}: code, not weights, which a weights-only load refuses (nothing of "
                "it ran)")
    return None


def nonfinite_parameter(model) -> Optional[str]:
    """The name of the first parameter (or buffer) of ``model`` holding NaN or inf, or None."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


def check_weights_load(model_cfg) -> None:
    """A local ``model.name_or_path`` loaded from its weights (not ``model.random_init``) has intact files
    (`weight_files_problem`); raises ``RecipeError`` naming the file."""
    local = Path(model_cfg.name_or_path).expanduser()
    if model_cfg.random_init or not local.is_dir():
        return
    problem = weight_files_problem(local)
    if problem is not None:
        raise RecipeError(
            f"`model.name_or_path: {model_cfg.name_or_path}` cannot be loaded: {problem}. Fix: copy the model "
            "directory again (or re-save it with `save_pretrained`), or point `model.name_or_path` at an intact one."
        )


def available_bytes(device: Optional[torch.device]) -> Tuple[int, str]:
    """Memory free for one process to build a model on ``device`` (a GPU, or None: the CPU) and how that was
    found. On the CPU: the kernel's ``MemAvailable`` shared by the ranks on this node (``LOCAL_WORLD_SIZE``)."""
    if device is not None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "1").strip()
    ranks = int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1
    try:
        with open("/proc/meminfo") as fh:
            kib = next(int(line.split()[1]) for line in fh if line.startswith("MemAvailable:"))
        free = kib * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    shared = f", shared by the {ranks} ranks on this node" if ranks > 1 else ""
    return free // ranks, f"available CPU memory{shared}"


def check_random_init_fits(model_cfg, config, kwargs, device: Optional[torch.device]) -> None:
    """Refuse, before a byte is allocated, a ``model.random_init`` model whose fp32 weights (it is initialised in
    fp32) exceed the memory free where it is built. Its size comes from the config's dimensions
    (`resolve_spec`), or, for an architecture they do not describe, from the model built on the meta device."""
    try:
        params = resolve_spec(model_cfg).num_params()
    except RecipeError:
        from transformers import AutoModelForCausalLM  # imported here: as in build_causal_lm

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config, **kwargs).parameters())
    need = 4 * params
    free, where = available_bytes(device)
    if need > free:
        gib = 2**30
        raise RecipeError(
            f"`model.random_init: true` would build `{model_cfg.name_or_path}`"
            + (" with `model.config_overrides`" if model_cfg.config_overrides else "")
            + f" as a model of {params / 1e9:.2f}B parameters: {need / gib:.1f} GiB of fp32 weights, but only "
            f"{free / gib:.1f} GiB are {where}. Nothing was allocated. Fix: shrink the model "
            "(`model.config_overrides`: hidden_size, intermediate_size, num_hidden_layers), or run where more memory "
            "is free."
        )


def build_causal_lm(model_cfg, precision: str, seed: int, zero3_init_config: Optional[dict] = None,
                    packing: bool = False):
    """Load (or, with ``model.random_init``, randomly initialise) a causal LM in ``precision``.

    ``zero3_init_config``: a DeepSpeed config dict; when given and ``random_init`` is off, weights are
    loaded straight into ZeRO-3 partitions (``HfDeepSpeedConfig``) so no rank holds a full copy.
    ``packing``: the run packs sequences (``model.attn_implementation: auto`` picks a mask-free attention on a GPU).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    model_cfg = gguf_models.resolve_model(model_cfg)  # a gguf: model: its converted directory (converted once)
    dtype = DTYPES[precision]
    kwargs = dict(trust_remote_code=model_cfg.trust_remote_code)
    attention = resolve_attention(model_cfg.attn_implementation, packing)
    if attention:
        kwargs["attn_implementation"] = attention
    try:
        if model_cfg.random_init:
            config = AutoConfig.from_pretrained(
                model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code, **model_cfg.config_overrides
            )
            # on a GPU, initialise there (seconds instead of minutes for billions of parameters on the CPU)
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            cheap = _REHEARSAL_WEIGHTS
            if not cheap:  # a rehearsal builds in the compute dtype, partitioned under ZeRO-3: not this estimate
                check_random_init_fits(model_cfg, config, kwargs, device)
            device_context = device or contextlib.nullcontext()
            with _fork_rng(seed, device), device_context, _zero3_init(cheap and zero3_init_config):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype if cheap else torch.float32, **kwargs)
                if cheap and zero3_init_config:
                    _fill_partitions(model, getattr(config, "initializer_range", 0.02))
            model = model.to(dtype)
        else:
            keep_alive = None
            if zero3_init_config is not None:
                from transformers.integrations import HfDeepSpeedConfig

                keep_alive = HfDeepSpeedConfig(zero3_init_config)  # noqa: F841 (must live during loading)
            check_weights_load(model_cfg)
            if model_cfg.config_overrides:
                kwargs["config"] = AutoConfig.from_pretrained(
                    model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code, **model_cfg.config_overrides
                )
            model = AutoModelForCausalLM.from_pretrained(model_cfg.name_or_path, dtype=dtype, **kwargs)
            del keep_alive
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise _remote_code_error("model", model_cfg.name_or_path) from None
        raise
    except OSError as exc:
        raise RecipeError(
            f"Could not load the model from `model.name_or_path` = `{model_cfg.name_or_path}` ({exc}). "
            "Fix: point it at a local model directory, or set `model.random_init=true` for a config-only directory."
        )
    apply_kernels(model, model_cfg.kernels)
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


def build_policy_and_reference(
    model_cfg, precision: str, seed: int, zero3_init_config: Optional[dict] = None, with_reference: bool = True,
    packing: bool = False,
) -> Tuple:
    """Two models with identical weights: the policy (trainable) and the reference (frozen; ``None`` when
    ``with_reference`` is false, for runs that never read it)."""
    policy = build_causal_lm(model_cfg, precision, seed, zero3_init_config, packing)
    if not with_reference:
        return policy, None
    if (model_cfg.random_init and not (_REHEARSAL_WEIGHTS and zero3_init_config)) or zero3_init_config is None:
        reference = copy.deepcopy(policy)
    else:
        reference = build_causal_lm(model_cfg, precision, seed, zero3_init_config, packing)
    if model_cfg.gradient_checkpointing:
        reference.gradient_checkpointing_disable()
    for param in reference.parameters():
        param.requires_grad_(False)
    reference.eval()
    return policy, reference


def _fill_partitions(model, std: float) -> None:
    """A rehearsal's ZeRO-3 partitions, filled on every rank as the initialisers fill weights (normal(0, std)
    matrices, ones for vectors). Only rank 0 initialises a ZeRO-3 model (transformers changes the gathered weights
    there and broadcasts them); under the fake process group nothing arrives, so another rank's partitions would
    hold whatever memory they were given, at times values whose squares overflow a norm into NaN gradients (the
    skipped updates a rank-1 rehearsal reported now and then). Shapes, dtypes and placement do not change."""
    with torch.no_grad():
        for param in model.parameters():
            part = getattr(param, "ds_tensor", None)
            if part is None:
                continue
            if len(param.ds_shape) >= 2:
                part.normal_(0.0, std)
            else:
                part.fill_(1.0)


@contextlib.contextmanager
def _zero3_init(config: Optional[dict]):
    """Models built inside are partitioned by DeepSpeed's ``zero.Init`` as they are created (``config``: a ZeRO-3
    DeepSpeed config; nothing happens without one)."""
    if not config:
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig  # deepspeed-backed: only a ZeRO-3 build needs it

    keep_alive = HfDeepSpeedConfig(config)  # noqa: F841 (transformers' from_config reads it while it lives)
    yield
    del keep_alive


@contextlib.contextmanager
def _fork_rng(seed: int, device: Optional[torch.device] = None):
    """Seeded random draws (on the CPU, and on ``device`` when it is a GPU) that leave the caller's RNG states as
    they were."""
    with torch.random.fork_rng(devices=[device] if device is not None else []):
        torch.manual_seed(seed)
        yield
