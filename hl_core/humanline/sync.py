"""The shard-local sync: each rank writes its own shard of every policy parameter into the matching reference shard.

Nothing is gathered and no collective runs: the two models share one sharding layout, so a rank's policy shard and
its reference shard cover the same elements. What "its own shard" is depends on the model:

* a plain ``nn.Module``, DDP, DeepSpeed ZeRO-0/1/2: the whole tensor (``param.data``);
* DeepSpeed ZeRO-3: the partition ``param.ds_tensor``, and, for a reference parameter held whole at the moment
  (persistent parameters, ``ds_persist``), the whole copy too, or the next forward would read a stale one;
* FSDP2 / DTensor parameters: the local shard (``DTensor.to_local()``);
* Megatron-core model chunks: each rank's tensor- and pipeline-parallel slices, which are plain tensors;
* a PEFT model with a trainable and a frozen ``reference`` LoRA adapter: the adapters' tensors.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import torch

from .functional import mix_into

Pair = Tuple[str, torch.Tensor, torch.Tensor]
Models = Union[torch.nn.Module, Sequence[torch.nn.Module]]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a wrapper holds as ``.module`` (a DeepSpeed engine, torch or Megatron DDP, Megatron's
    ``Float16Module``), recursively."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def _named_parameters(models: Models) -> List[Tuple[str, torch.nn.Parameter]]:
    """``named_parameters`` of one model, or of a list of model chunks (Megatron's virtual pipeline stages) with
    the chunk's index in front of each name."""
    if isinstance(models, torch.nn.Module):
        return list(_unwrap(models).named_parameters())
    return [(f"{i}.{name}", p) for i, chunk in enumerate(models) for name, p in _unwrap(chunk).named_parameters()]


def _holds_whole(param) -> bool:
    """A ZeRO-3 parameter currently gathered on this rank (``.data`` is the full tensor). DeepSpeed's
    ``ZeroParamStatus`` is read by name: this package imports no engine library."""
    return param.ds_status.name == "AVAILABLE" and param.data.numel() == param.ds_numel


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds: a DTensor's local shard (a view under no-grad), else the tensor's data."""
    data = tensor.data
    return data.to_local() if hasattr(data, "to_local") else data


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@torch.no_grad()
def sync_pair(policy: torch.Tensor, reference: torch.Tensor, mix: float = 1.0) -> int:
    """Mix (``mix_into``) this rank's shard of ``policy`` into the matching shard of ``reference``; returns the bytes
    written. No collective: a ZeRO-3 reference parameter held whole while its policy twin is not is released
    (``partition()``), so its next forward re-gathers the fresh partition."""
    if not hasattr(policy, "ds_tensor"):
        ref = _local(reference)
        mix_into(ref, _local(policy), mix)
        return _nbytes(ref)
    mix_into(reference.ds_tensor.data, policy.ds_tensor.data, mix)
    written = _nbytes(reference.ds_tensor)
    if _holds_whole(reference):
        if _holds_whole(policy):
            mix_into(reference.data, policy.data, mix)
            written += _nbytes(reference.data)
        else:
            reference.partition()
    return written


class ParameterPairs:
    """The matching ``(name, policy parameter, reference parameter)`` of two models of one layout.

    Build it with ``pair_parameters`` or ``pair_lora_adapters``; ``sync`` is the shard-local copy.
    """

    def __init__(self, pairs: Sequence[Pair]):
        self.pairs: List[Pair] = list(pairs)

    def __iter__(self) -> Iterator[Pair]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def sync(self, mix: float = 1.0) -> int:
        """Write this rank's shard of every policy parameter into the reference's (``mix`` 1: a copy; else
        ``ref = mix * policy + (1 - mix) * ref``). Gathers nothing and runs no collective.

        Returns:
            The bytes written on this rank.
        """
        return sum(sync_pair(policy, reference, mix) for _, policy, reference in self.pairs)

    def shard_bytes(self) -> int:
        """The bytes of this rank's reference shards: what one sync writes (plus any ZeRO-3 whole copies)."""
        return sum(_nbytes(ref.ds_tensor if hasattr(ref, "ds_tensor") else _local(ref)) for _, _, ref in self.pairs)

    def reference_shards(self) -> dict:
        """``name -> a CPU copy of this rank's reference shard`` (checkpointing a reference that syncing moved)."""
        out = {}
        for name, _, ref in self.pairs:
            shard = ref.ds_tensor if hasattr(ref, "ds_tensor") else _local(ref)
            out[name] = shard.detach().cpu().clone()
        return out

    @torch.no_grad()
    def load_reference_shards(self, shards: dict) -> None:
        """The inverse of ``reference_shards`` on the same layout (the same ZeRO stage, world size and TP/PP).

        Raises:
            ValueError: a parameter is missing from ``shards`` or its shard has another shape.
        """
        for name, _, ref in self.pairs:
            local = ref.ds_tensor if hasattr(ref, "ds_tensor") else _local(ref)
            if name not in shards or tuple(shards[name].shape) != tuple(local.shape):
                found = tuple(shards[name].shape) if name in shards else "nothing"
                raise ValueError(f"the saved reference shards hold {found} for `{name}` where this rank's shard is "
                                 f"{tuple(local.shape)}: restore on the layout that saved them (the same ZeRO stage, "
                                 "number of processes and TP/PP sizes), each rank its own file")
        for name, _, ref in self.pairs:
            target = ref.ds_tensor.data if hasattr(ref, "ds_tensor") else _local(ref)
            target.copy_(shards[name].to(target.device, target.dtype))
            if hasattr(ref, "ds_tensor") and _holds_whole(ref):
                ref.partition()  # the next forward gathers the loaded partition


def pair_parameters(policy: Models, reference: Models) -> ParameterPairs:
    """Pair the parameters of two models that share one layout, for ``ReferenceSync``.

    Args:
        policy: the trained model: an ``nn.Module``, a DDP or FSDP2 module, a DeepSpeed engine (ZeRO 0-3), or a
            list of Megatron-core model chunks (DDP- or ``Float16Module``-wrapped or not).
        reference: the reference, of the same kind and layout (a ZeRO-3 policy needs a ZeRO-3 reference engine:
            ``deepspeed.initialize`` without an optimizer; Megatron chunks built with the same TP/PP).

    Returns:
        The pairs, in ``named_parameters`` order.

    Raises:
        ValueError: the two models' parameter names or shapes differ.
    """
    pol, ref = _named_parameters(policy), _named_parameters(reference)
    if [n for n, _ in pol] != [n for n, _ in ref]:
        only = sorted(set(n for n, _ in pol) ^ set(n for n, _ in ref))[:3]
        raise ValueError(f"the policy's and the reference's parameters differ in names or order (e.g. {only}): "
                         "pair two models built alike")
    for (name, p), (_, r) in zip(pol, ref):
        p_shape, r_shape = _local(getattr(p, "ds_tensor", p)).shape, _local(getattr(r, "ds_tensor", r)).shape
        if p_shape != r_shape:
            raise ValueError(f"`{name}`: the policy's local shard is {tuple(p_shape)} but the reference's is "
                             f"{tuple(r_shape)}: build both models with one sharding layout")
    return ParameterPairs([(name, p, r) for (name, p), (_, r) in zip(pol, ref)])


LORA_LAYER_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def adapter_tensors(layer, adapter: str) -> List[Tuple[str, torch.nn.Parameter]]:
    """``(part name, parameter)`` of LoRA ``adapter`` in one PEFT layer."""
    out = []
    for part in LORA_LAYER_PARTS:
        holder = getattr(layer, part, None)
        if holder is None or adapter not in holder:
            continue
        item = holder[adapter]
        if isinstance(item, torch.nn.Parameter):
            out.append((part, item))
        else:
            out += [(f"{part}.{name}", p) for name, p in item.named_parameters()]
    return out


def pair_lora_adapters(model: torch.nn.Module, policy_adapter: str = "default",
                       reference_adapter: str = "reference") -> ParameterPairs:
    """Pair a PEFT model's trainable LoRA adapter with a frozen twin adapter that serves as the reference.

    Args:
        model: a PEFT model (or a DeepSpeed engine holding one) with both adapters on the same layers.
        policy_adapter: the trained adapter's name.
        reference_adapter: the frozen adapter's name (``model.add_adapter(name, same_config)``).

    Returns:
        The pairs, named by the reference adapter's parameter names.
    """
    names = {id(p): n for n, p in _unwrap(model).named_parameters()}
    pairs, layouts_differ = [], False
    for layer in lora_layers(model):
        pol, ref = adapter_tensors(layer, policy_adapter), adapter_tensors(layer, reference_adapter)
        layouts_differ |= [n for n, _ in pol] != [n for n, _ in ref]
        pairs += [(names[id(r)], p, r) for (_, p), (_, r) in zip(pol, ref)]
    if not pairs:
        raise ValueError(f"no layer holds both a `{policy_adapter}` and a `{reference_adapter}` LoRA adapter")
    if layouts_differ:
        raise ValueError(f"the `{policy_adapter}` and `{reference_adapter}` adapters differ in layout: add the "
                         "reference adapter with the policy adapter's LoraConfig")
    return ParameterPairs(pairs)


def lora_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """PEFT's LoRA layers of ``model`` (or of the PEFT model a wrapper holds), found without importing PEFT."""
    return [m for m in _unwrap(model).modules() if hasattr(m, "lora_A")]


@contextlib.contextmanager
def active_lora_adapter(model: torch.nn.Module, adapter: Optional[str]):
    """Run ``model``'s LoRA layers with ``adapter`` only (``None``: with no adapter, the base model) for the block.

    The layers' ``_active_adapter`` / ``_disable_adapters`` are set directly and restored on exit: PEFT's
    ``set_adapter`` and ``disable_adapter`` also rewrite ``requires_grad``, which must not change under an optimizer's
    or DeepSpeed's bookkeeping. The model's train/eval mode is left as it is.

    Args:
        model: a PEFT model, or a wrapper holding one (a DeepSpeed engine, DDP).
        adapter: the adapter to run (``"ref"``, ``"reference"``), or ``None`` for none.
    """
    layers = lora_layers(model)
    saved = [(layer, layer.__dict__.get("_active_adapter"), layer.__dict__.get("_disable_adapters"))
             for layer in layers]
    for layer in layers:
        if adapter is None:
            layer._disable_adapters = True
        else:
            layer._active_adapter = [adapter]
    try:
        yield
    finally:
        for layer, active, disabled in saved:
            for attr, value in (("_active_adapter", active), ("_disable_adapters", disabled)):
                if value is None:
                    layer.__dict__.pop(attr, None)
                else:
                    setattr(layer, attr, value)
