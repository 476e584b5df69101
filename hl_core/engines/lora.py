"""LoRA through PEFT for the DeepSpeed engine (``model.lora``): one model, no second engine.

* The policy is ``peft.get_peft_model(base, LoraConfig(...))``; only the adapter named ``default`` trains
  (the optimizer gets trainable parameters only).
* Frozen reference (no syncing): the same module with every adapter switched off, i.e. the base model.
* Synced reference: a second adapter, ``reference``, frozen (``requires_grad`` false, never in the optimizer);
  a sync copies the ``default`` adapter's tensors into it, nothing else (``LoraAdapters.pairs``).
* Reference forwards run in eval mode (no dropout) with the layers' active adapter switched by setting the
  PEFT layer attributes directly (``_active_adapter`` / ``_disable_adapters``): PEFT's ``set_adapter`` and
  ``disable_adapter`` also rewrite ``requires_grad``, which must not change under DeepSpeed's gradient hooks.
* ``final/``: the ``default`` adapter in PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``);
  with ``model.lora.save_merged`` also ``final/merged/``, the base weights plus each layer's
  ``get_delta_weight`` (computed beside the model; the training weights are not touched).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..errors import RecipeError
from ..humanline import ParameterPairs, pair_lora_adapters
from ..humanline.sync import LORA_LAYER_PARTS, active_lora_adapter, adapter_tensors
from ..models.loading import _fork_rng

# Imports inside functions: PEFT is an optional extra (`pip install -e .[lora]`), loaded only for `model.lora`.

POLICY, REFERENCE = "default", "reference"
def lora_config(lora):
    """PEFT's ``LoraConfig`` for the recipe's ``model.lora`` block."""
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=lora.target_modules,
                      bias="none", task_type="CAUSAL_LM")


def wrap_lora(base, lora, synced: bool, seed: int, gradient_checkpointing: bool = False):
    """``base`` with the ``default`` adapter (trainable; its random init seeded by ``seed``) and, when ``synced``,
    a frozen ``reference`` copy of it."""
    from peft import get_peft_model


    config = lora_config(lora)
    if gradient_checkpointing:
        base.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need a grad path
    device = next(base.parameters()).device
    try:
        with _fork_rng(seed, device if device.type == "cuda" else None):  # the same adapter init on every run
            model = get_peft_model(base, config, autocast_adapter_dtype=False)  # the adapter in the model's dtype
            if synced:
                model.add_adapter(REFERENCE, lora_config(lora))
    except ValueError as exc:
        if "target" not in str(exc).lower():
            raise
        names = sorted({name.rsplit(".", 1)[-1] for name, m in base.named_modules()
                        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))})
        raise RecipeError(
            f"`model.lora.target_modules: {lora.target_modules}` matches no layer PEFT can adapt in this model "
            f"({str(exc).strip().splitlines()[0][:200]}). Fix: name some of its linear layers: {', '.join(names)}."
        ) from None
    return LoraAdapters(model, synced)


class LoraAdapters:
    """The adapters of one PEFT model: reference forwards, the sync's parameter pairs, export."""

    def __init__(self, model, synced: bool):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model, self.synced = model, synced
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        self.policy_params = [p for layer in self.layers for _, p in adapter_tensors(layer, POLICY)]
        # (reference name, policy tensor, reference tensor): humanline's sync pairs, and the checkpoint's
        self.pairs = pair_lora_adapters(model, POLICY, REFERENCE) if synced else ParameterPairs([])
        with torch.no_grad():
            for _, pol, ref in self.pairs:
                ref.requires_grad_(False)
                ref.copy_(pol)  # the reference starts as the policy (a sync at update 0 is then a no-op)
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        if trainable != {id(p) for p in self.policy_params}:
            raise RuntimeError("LoRA: exactly the policy adapter must be trainable")

    @property
    def adapter_bytes(self) -> int:
        """Bytes of the trainable adapter: what a sync copies."""
        return sum(p.numel() * p.element_size() for p in self.policy_params)

    @contextlib.contextmanager
    def reference_forward(self):
        """The module as the reference: eval mode, and the ``reference`` adapter (synced) or no adapter (frozen)."""
        model = self.model
        was_training = model.training
        model.eval()
        try:
            with active_lora_adapter(model, REFERENCE if self.synced else None):
                yield
        finally:
            model.train(was_training)

    @torch.no_grad()
    def merged_state_dict(self):
        """The base model's weights with the policy adapter merged in, under the base model's own names."""
        base = self.model.get_base_model()
        deltas, layers = {}, {id(layer) for layer in self.layers}
        for name, module in base.named_modules():
            if id(module) in layers and POLICY in getattr(module, "scaling", {}):
                deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(POLICY)
        merged = {}
        for key, value in base.state_dict().items():
            if any(f".{part}." in key for part in LORA_LAYER_PARTS):
                continue
            if key in deltas:
                value = value + deltas[key].to(value.dtype)
            merged[key.replace(".base_layer.", ".")] = value.detach().cpu().contiguous()
        return merged

    def save_final(self, directory: str, tokenizer, merged: bool) -> None:
        """``directory``: the policy adapter (PEFT format) and the tokenizer; ``merged``: also ``merged/``."""
        self.model.save_pretrained(directory, selected_adapters=[POLICY], safe_serialization=True)
        tokenizer.save_pretrained(directory)
        if merged:
            target = Path(directory) / "merged"
            self.model.get_base_model().save_pretrained(str(target), state_dict=self.merged_state_dict(),
                                                        safe_serialization=True)
            tokenizer.save_pretrained(str(target))
