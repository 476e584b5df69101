"""``--plan`` with ``model.lora``: the adapter's size from the model's dimensions and PEFT's own target matching.

The decoder's module tree (Llama / Qwen2 / Gemma 2 names, as transformers builds them) is listed with each
module's input and output width; a module gets an adapter when PEFT's ``check_target_module_exists`` says so
(``target_modules: null``: PEFT's default for the model type; ``all-linear``: every linear layer but the output
head). An adapted ``in -> out`` layer holds ``r * (in + out)`` adapter parameters (A: ``r x in``, B: ``out x r``).

Per token and layer the adapters keep for backward: A's output (``r`` values, which B's weight gradient needs)
and, with ``model.lora.dropout > 0``, the dropped copy of the layer's input (``in`` values) and its mask (one
byte each); without dropout A reads the layer's input, which is kept anyway. The frozen base layers are counted
as in full fine-tuning (an upper bound: a frozen linear layer needs not keep its input).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

from ..errors import RecipeError

# Imports inside functions: PEFT is an optional extra, loaded only to plan `model.lora`.

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_widths(spec) -> List[Tuple[str, int, int, bool]]:
    """``(full name, in, out, is_linear)`` of the modules LoRA can adapt."""
    h, q, kv, inter = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    shapes = {"q_proj": ("self_attn", h, q), "k_proj": ("self_attn", h, kv), "v_proj": ("self_attn", h, kv),
              "o_proj": ("self_attn", q, h), "gate_proj": ("mlp", h, inter), "up_proj": ("mlp", h, inter),
              "down_proj": ("mlp", inter, h)}
    out = [("model.embed_tokens", spec.vocab_size, h, False)]
    for i in range(spec.num_layers):
        out += [(f"model.layers.{i}.{block}.{name}", a, b, True) for name, (block, a, b) in shapes.items()]
    out.append(("lm_head", h, spec.vocab_size, True))
    return out


def lora_terms(spec, lora, pb: int) -> Dict[str, float]:
    """``adapter_params`` (one adapter) and ``activation_bytes_per_token`` (all layers) for ``model.lora``."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    targets = lora.target_modules
    if targets is None:
        targets = DEFAULTS.get(spec.model_type)
        if targets is None:
            raise RecipeError(
                f"PEFT has no default `target_modules` for model type `{spec.model_type}`. Fix: set "
                f"`model.lora.target_modules`, e.g. `[{', '.join(LINEAR_NAMES)}]`."
            )
    if targets == "all-linear":
        matched = [m for m in module_widths(spec) if m[3] and m[0] != "lm_head"]
    else:
        config = LoraConfig(r=lora.r, target_modules=targets)
        matched = [m for m in module_widths(spec) if check_target_module_exists(config, m[0])]
    if not matched:
        raise RecipeError(
            f"`model.lora.target_modules: {lora.target_modules}` matches no layer of {spec.name}. Fix: name some of "
            f"its linear layers: {', '.join(LINEAR_NAMES)}, lm_head."
        )
    r = lora.r
    params = sum(r * (a + b) for _, a, b, _ in matched)
    kept = sum(pb * r + ((pb + 1) * a if lora.dropout > 0 else 0) for _, a, _, _ in matched)
    return {"adapter_params": params, "activation_bytes_per_token": kept, "adapted_modules": len(matched)}
