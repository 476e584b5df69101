"""Loading tokenizers and causal-LM weights for the engines (Hugging Face formats)."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Optional, Tuple

import torch

from ..errors import RecipeError
from ..models.specs import resolve_spec

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
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _remote_code_error(what: str, name: str) -> RecipeError:
    return RecipeError(
        f"The {what} at `{name}` comes with custom modelling code, which runs only with "
        "`model.trust_remote_code: true`. Fix: read that code, then set `model.trust_remote_code=true`, or use "
        "a model that transformers supports natively."
    )


def load_tokenizer(model_cfg):
    """The tokenizer of ``model.tokenizer`` (default ``model.name_or_path``), with a pad token; refused when
    it has more tokens than the model's vocabulary (see :func:`check_vocab`)."""
    from transformers import AutoTokenizer

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
    except (OSError, ValueError) as exc:
        if "trust_remote_code" in str(exc):
            raise _remote_code_error("tokenizer", name) from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(
            f"Could not load the tokenizer from `{key}` = `{name}` ({first}). "
            "Fix: point it at a local directory with tokenizer files, or a Hugging Face name reachable from this machine."
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


def build_causal_lm(model_cfg, precision: str, seed: int, zero3_init_config: Optional[dict] = None):
    """Load (or, with ``model.random_init``, randomly initialise) a causal LM in ``precision``.

    ``zero3_init_config``: a DeepSpeed config dict; when given and ``random_init`` is off, weights are
    loaded straight into ZeRO-3 partitions (``HfDeepSpeedConfig``) so no rank holds a full copy.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = DTYPES[precision]
    kwargs = dict(trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.attn_implementation:
        kwargs["attn_implementation"] = model_cfg.attn_implementation
    try:
        if model_cfg.random_init:
            config = AutoConfig.from_pretrained(
                model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code, **model_cfg.config_overrides
            )
            # on a GPU, initialise there (seconds instead of minutes for billions of parameters on the CPU)
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            cheap = _REHEARSAL_WEIGHTS
            with _fork_rng(seed, device), (device or contextlib.nullcontext()), _zero3_init(cheap and zero3_init_config):
                model = AutoModelForCausalLM.from_config(config, dtype=dtype if cheap else torch.float32, **kwargs)
            model = model.to(dtype)
        else:
            keep_alive = None
            if zero3_init_config is not None:
                from transformers.integrations import HfDeepSpeedConfig

                keep_alive = HfDeepSpeedConfig(zero3_init_config)  # noqa: F841 (must live during loading)
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
    if model_cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model


def build_policy_and_reference(
    model_cfg, precision: str, seed: int, zero3_init_config: Optional[dict] = None, with_reference: bool = True
) -> Tuple:
    """Two models with identical weights: the policy (trainable) and the reference (frozen; ``None`` when
    ``with_reference`` is false, for runs that never read it)."""
    policy = build_causal_lm(model_cfg, precision, seed, zero3_init_config)
    if not with_reference:
        return policy, None
    if (model_cfg.random_init and not (_REHEARSAL_WEIGHTS and zero3_init_config)) or zero3_init_config is None:
        reference = copy.deepcopy(policy)
    else:
        reference = build_causal_lm(model_cfg, precision, seed, zero3_init_config)
    if model_cfg.gradient_checkpointing:
        reference.gradient_checkpointing_disable()
    for param in reference.parameters():
        param.requires_grad_(False)
    reference.eval()
    return policy, reference


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
    """Seeded random draws (on the CPU, and on ``device`` when it is a GPU) that leave the caller's RNG states as they were."""
    with torch.random.fork_rng(devices=[device] if device is not None else []):
        torch.manual_seed(seed)
        yield
