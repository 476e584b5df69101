"""Loading tokenizers and causal-LM weights for the engines (Hugging Face formats)."""

from __future__ import annotations

import contextlib
import copy
from typing import Optional, Tuple

import torch

from .errors import RecipeError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def load_tokenizer(model_cfg):
    from transformers import AutoTokenizer

    name = model_cfg.tokenizer or model_cfg.name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as exc:
        raise RecipeError(
            f"Could not load the tokenizer from `model.tokenizer`/`model.name_or_path` = `{name}` ({exc}). "
            "Fix: point it at a local directory with tokenizer files, or a Hugging Face name reachable from this machine."
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
            with _fork_rng(seed, device), (device or contextlib.nullcontext()):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
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
    if model_cfg.random_init or zero3_init_config is None:
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
def _fork_rng(seed: int, device: Optional[torch.device] = None):
    """Seeded random draws (on the CPU, and on ``device`` when it is a GPU) that leave the caller's RNG states as they were."""
    with torch.random.fork_rng(devices=[device] if device is not None else []):
        torch.manual_seed(seed)
        yield
