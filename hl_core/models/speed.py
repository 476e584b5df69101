"""The model-side speed switches: Liger-Kernel's patches (``model.kernels``), the families whose log-probs can come
from the last hidden state (``train.fused_logprobs``), the attention backend ``model.attn_implementation: auto``
picks, and regional compilation (``train.compile``: each decoder layer compiled on its own, as torchtune and
torchtitan do), with its compile time and recompiles for the run summary."""

from __future__ import annotations

import importlib.util
from typing import Dict, Optional

import torch

from ..errors import RecipeError
from ..logprobs.hidden import causal_lm
from .specs import resolve_spec

# Imports inside functions: liger-kernel is optional (GPU only), loaded only for `model.kernels: liger`.

# model_type -> (Liger's patching function, its MLP switch): the families of our recipes
LIGER_PATCHES = {"llama": ("apply_liger_kernel_to_llama", "swiglu"), "qwen2": ("apply_liger_kernel_to_qwen2", "swiglu"),
                 "gemma2": ("apply_liger_kernel_to_gemma2", "geglu")}
# families whose logits are exactly `lm_head(final hidden state)` (Gemma 2: then its final-logit soft-cap, which
# `hl_core.logprobs.hidden` applies from the config)
HIDDEN_LOGPS_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")


def known_model_type(model_cfg) -> Optional[str]:
    """``model_type`` from the model's config.json (local, or in the Hugging Face cache); None when it is not at
    hand."""
    try:
        return resolve_spec(model_cfg).model_type
    except RecipeError:
        return None


def check_speed_options(model_cfg, fused_logprobs: bool, model_type: Optional[str] = None,
                        cuda: Optional[bool] = None) -> None:
    """``model.kernels`` (of the ``model`` section ``model_cfg``) and ``train.fused_logprobs`` against the model family
    and the machine (a ``RecipeError`` naming the key). ``model_type``: the built model's (default: from its
    config.json, unchecked when unknown); ``cuda``: whether this machine has a CUDA GPU (default: asks torch)."""
    kernels, fused = model_cfg.kernels, fused_logprobs
    if kernels == "none" and not fused:
        return
    model_type = model_type or known_model_type(model_cfg)
    if kernels == "liger":
        cuda = torch.cuda.is_available() if cuda is None else cuda
        why = None
        if not cuda:
            why = "Liger-Kernel's kernels are Triton GPU kernels, and this machine has no CUDA GPU"
        elif model_type is not None and model_type not in LIGER_PATCHES:
            why = (f"the model is a `{model_type}`, a family this recipe pack does not patch (Liger patches here: "
                   f"{', '.join(LIGER_PATCHES)})")
        elif importlib.util.find_spec("liger_kernel") is None:
            why = "the `liger-kernel` package is not installed (`pip install -e .[gpu]`)"
        if why:
            raise _liger_refusal(why)
    if fused and model_type is not None and model_type not in HIDDEN_LOGPS_FAMILIES:
        raise RecipeError(
            f"`train.fused_logprobs: true` computes log-probs from the last hidden state and the output layer, which "
            f"is "
            f"known to give the model's logits for {', '.join(HIDDEN_LOGPS_FAMILIES)}; this model is a `{model_type}` "
            "(its forward may scale or shift its logits). Fix: `train.fused_logprobs=false`.")


def _liger_refusal(why: str) -> RecipeError:
    return RecipeError(f"`model.kernels: liger` cannot be used here: {why}. Fix: `model.kernels=none` (the "
                       "transformers modules), or run on a GPU with a Llama, Qwen 2.5 or Gemma 2 model.")


def apply_kernels(model: torch.nn.Module, kernels: str) -> None:
    """``model.kernels: liger``: Liger's own patching function for the model's family, on this instance: RMSNorm,
    RoPE and SwiGLU/GeGLU kernels. Its cross-entropy patches stay off: log-probs are ours (``train.fused_logprobs``
    uses Liger's fused linear cross-entropy itself on a GPU)."""
    if kernels != "liger":
        return
    import liger_kernel.transformers as liger  # optional, GPU only

    lm = causal_lm(model)
    if lm.config.model_type not in LIGER_PATCHES:
        raise _liger_refusal(f"the model is a `{lm.config.model_type}`, a family this recipe pack does not patch")
    name, mlp = LIGER_PATCHES[lm.config.model_type]
    getattr(liger, name)(rope=True, rms_norm=True, cross_entropy=False, fused_linear_cross_entropy=False,
                         **{mlp: True}, model=lm)


def resolve_attention(choice: Optional[str], packing: bool, cuda: Optional[bool] = None) -> Optional[str]:
    """``model.attn_implementation`` for transformers. ``auto``: on a GPU with ``data.packing``, an attention that
    takes packed sequences without a dense mask (flash-attention 2's variable-length path from ``position_ids``
    when ``flash-attn`` is installed, else FlexAttention's document mask); otherwise ``sdpa`` (the CPU's choice)."""
    if choice != "auto":
        return choice
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not (cuda and packing):
        return "sdpa"
    return "flash_attention_2" if importlib.util.find_spec("flash_attn") is not None else "flex_attention"


class RegionalCompile:
    """``train.compile``: each decoder layer of each model compiled on its own (``nn.Module.compile``: the module
    stays itself, so checkpoints, syncing and ZeRO see the same parameters), with dynamic shapes so packing's and
    token budgets' varying lengths reuse one graph. Layers share their compiled code; what compiles again is a
    new grad mode (the reference's no-grad forward) or a dimension of size 1 (a one-row micro-batch). Generation
    runs its layers eagerly (``eager()``): its one-token steps and KV caches are not what the layers were compiled for.
    """

    def __init__(self, backend: str = "inductor"):
        self.layers, self.backend = 0, backend
        torch._dynamo.utils.clear_compilation_metrics()  # this run's compiles only (a process may hold several runs)

    def compile(self, model: torch.nn.Module) -> None:
        for layer in causal_lm(model).get_decoder().layers:
            layer.compile(backend=self.backend, dynamic=True)
            self.layers += 1

    @staticmethod
    def eager():
        """A context in which compiled layers run their plain Python forward."""
        return torch.compiler.set_stance("force_eager")

    def summary(self) -> Dict[str, float]:
        """Compile time (forward and backward graphs), graphs compiled and recompiles since this object was made."""
        events = torch._dynamo.utils.get_compilation_metrics()
        seconds = sum((e.entire_frame_compile_time_s or 0.0) + (e.backward_cumulative_compile_time_us or 0) / 1e6
                      for e in events)
        return {"compiled_layers": self.layers, "compile_backend": self.backend, "compile_s": round(seconds, 2),
                "compiled_graphs": len(events),
                "recompiles": sum(1 for e in events if e.recompile_reason)}
