"""A PEFT/LoRA policy on the humanline TRL trainers: the reference is a second LoRA adapter, not a second model.

TRL already keeps a PEFT policy's reference as an adapter named ``ref`` when it is given a ``PeftModel`` (a copy of
the trained adapter, frozen); with ``peft_config=`` it uses the base model (adapters disabled), which nothing could
sync. The humanline trainers make sure the ``ref`` adapter exists (a frozen copy of the policy's adapter, added
after TRL built the model), run the reference as the policy module with that adapter active (no grad, eval mode),
and sync it from the policy's adapter with ``hl_core.humanline.pair_lora_adapters``: adapter tensors only, each
rank its own shard, as the pack's own ``model.lora`` does.
"""

from __future__ import annotations

from typing import Optional

import torch

from hl_core.humanline import ParameterPairs, pair_lora_adapters, pair_parameters
from hl_core.humanline.sync import _unwrap, active_lora_adapter

from .compat import HumanlineTrlSettingError

REFERENCE_ADAPTER = "ref"  # TRL's own name for a PEFT policy's reference adapter


def peft_policy(model: torch.nn.Module):
    """The ``PeftModel`` inside ``model`` (a wrapper such as a DeepSpeed engine, or the model itself), or ``None``."""
    model = _unwrap(model)
    return model if callable(getattr(model, "add_adapter", None)) and hasattr(model, "peft_config") else None


def policy_adapter(peft_model) -> str:
    """The name of the adapter being trained (the one active outside the reference's forwards)."""
    return peft_model.active_adapters[0]


def ensure_reference_adapter(trainer: str, peft_model) -> None:
    """Add the frozen ``ref`` adapter, a copy of the policy's, unless TRL added it already; freeze it.

    Raises:
        HumanlineTrlSettingError: the PEFT method is not LoRA (prompt learning keeps no per-layer adapter to
            copy, run or sync).
    """
    name = policy_adapter(peft_model)
    config = peft_model.peft_config[name]
    if type(config).__name__ != "LoraConfig":
        raise HumanlineTrlSettingError(
            f"{trainer} takes a LoRA policy (`peft.LoraConfig`), and this one is trained with "
            f"`{type(config).__name__}`: humanline's reference is a second LoRA adapter, a copy of the policy's that "
            "is synced every k updates, and a prompt-learning method keeps no per-layer adapter to copy, run as the "
            "reference or sync. Fix: use `peft_config=LoraConfig(...)`, or train the full model (no `peft_config`)."
        )
    added = REFERENCE_ADAPTER not in peft_model.peft_config
    if added:
        peft_model.add_adapter(REFERENCE_ADAPTER, config)
    with torch.no_grad():
        for _, policy, reference in pair_lora_adapters(peft_model, name, REFERENCE_ADAPTER):
            reference.requires_grad_(False)
            if added:  # TRL's own `ref` adapter is already the copy it was given
                reference.copy_(policy)


class AdapterReference:
    """A PEFT policy called as its own reference: the ``ref`` adapter active, eval mode, for one call.

    Args:
        policy: the policy as the trainer calls it (the PEFT model, or the wrapper holding it).
    """

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        was_training = self.policy.training
        self.policy.eval()
        try:
            with active_lora_adapter(self.policy, REFERENCE_ADAPTER):
                return self.policy(*args, **kwargs)
        finally:
            self.policy.train(was_training)


def reference_pairs(policy: torch.nn.Module, ref_model: Optional[torch.nn.Module]) -> ParameterPairs:
    """What the sync copies: the whole policy into ``ref_model``, or, with a PEFT policy and no reference model,
    the policy's adapter into its ``ref`` adapter.

    Raises:
        HumanlineTrlSettingError: there is no reference to sync (a PEFT policy whose reference is the base model).
    """
    if ref_model is not None:
        return pair_parameters(policy, ref_model)
    peft_model = peft_policy(policy)
    if peft_model is not None and REFERENCE_ADAPTER in peft_model.peft_config:
        return pair_lora_adapters(policy, policy_adapter(peft_model), REFERENCE_ADAPTER)
    raise HumanlineTrlSettingError(
        "the trainer keeps no reference that could be synced: it has no `ref_model`, and its policy is not a PEFT "
        f"model with a `{REFERENCE_ADAPTER}` adapter (with `peft_config=`, TRL's reference is the base model with the "
        "adapters disabled, which syncing would overwrite). Fix: give the trainer a `ref_model`, or pass a "
        "`PeftModel` (TRL then keeps a frozen `ref` copy of its adapter, which the callback syncs), or use the "
        "humanline trainers, which add that adapter themselves."
    )
