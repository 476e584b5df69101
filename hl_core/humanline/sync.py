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
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import HumanlineStateError, SyncUsageError
from .contract import describe, real_number, refuse
from .functional import mix_unchecked

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


def _shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a parameter: its ZeRO-3 partition, a DTensor's local shard, or the whole tensor."""
    return tensor.ds_tensor if hasattr(tensor, "ds_tensor") else _local(tensor)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one tensor or share their memory (a copy into one would write the other)."""
    if a is b:
        return True
    a, b = _shard(a), _shard(b)
    return a.numel() > 0 and b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@torch.no_grad()
def sync_pair(policy: torch.Tensor, reference: torch.Tensor, mix: float = 1.0) -> int:
    """Mix (``functional.mix_into``) this rank's shard of ``policy`` into the matching shard of ``reference``;
    returns the bytes written. No collective: a ZeRO-3 reference parameter held whole while its policy twin is not is
    released (``partition()``), so its next forward re-gathers the fresh partition. Arguments as ``ParameterPairs``
    checked them."""
    if not hasattr(policy, "ds_tensor"):
        ref = _local(reference)
        mix_unchecked(ref, _local(policy), mix)
        return _nbytes(ref)
    mix_unchecked(reference.ds_tensor.data, policy.ds_tensor.data, mix)
    written = _nbytes(reference.ds_tensor)
    if _holds_whole(reference):
        if _holds_whole(policy):
            mix_unchecked(reference.data, policy.data, mix)
            written += _nbytes(reference.data)
        else:
            reference.partition()
    return written


Owners = Dict[int, List[Tuple[torch.nn.Module, str]]]  # id(tensor) -> (module, attribute) that hold it


def _owners(models: Iterable[torch.nn.Module], tensors: Iterable[torch.Tensor]) -> Owners:
    """Where each of ``tensors`` sits in ``models``: every ``(module, attribute)`` whose ``_parameters`` holds it (a
    tied weight has two), so that a parameter replaced later (``load_state_dict(..., assign=True)``, a new
    ``nn.Parameter`` assigned) is noticed."""
    wanted = {id(t) for t in tensors}
    owners: Owners = {}
    for model in models:
        for module in _unwrap(model).modules():
            for attr, param in module._parameters.items():
                if param is not None and id(param) in wanted:
                    owners.setdefault(id(param), []).append((module, attr))
    return owners


_PAIRS_FIX = ("pair two distinct models of one layout with pair_parameters(policy, reference) (or "
              "pair_lora_adapters), or pass ParameterPairs a list of (name, policy tensor, reference tensor)")


class ParameterPairs:
    """The matching ``(name, policy parameter, reference parameter)`` of two models of one layout.

    Build it with ``pair_parameters`` or ``pair_lora_adapters``; ``sync`` is the shard-local copy.

    Args:
        pairs: ``(name, policy tensor, reference tensor)`` triples: unique names, floating-point tensors whose local
            shards have one shape, a reference tensor in one pair only and never the policy tensor itself (nor one
            sharing its memory).
        models: the modules the tensors belong to (``pair_parameters`` passes both models): a sync then refuses
            (``SyncUsageError``) once any paired parameter is no longer the one a module holds.

    Raises:
        HumanlineUsageError: ``pairs`` breaks the rules above.
    """

    def __init__(self, pairs: Sequence[Pair], models: Sequence[torch.nn.Module] = ()):
        self.pairs: List[Pair] = _checked_pairs(pairs)
        self._owners = (dict(pairs._owners) if isinstance(pairs, ParameterPairs)
                        else _owners(models, [t for _, p, r in self.pairs for t in (p, r)]))

    def __iter__(self) -> Iterator[Pair]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def replaced(self) -> List[str]:
        """The names of pairs whose policy or reference parameter a module no longer holds (replaced since pairing,
        e.g. by ``load_state_dict(..., assign=True)``): a sync would write or read tensors nothing uses."""
        stale = []
        for name, policy, reference in self.pairs:
            for tensor in (policy, reference):
                if any(module._parameters.get(attr) is not tensor for module, attr in self._owners.get(id(tensor), ())):
                    stale.append(name)
                    break
        return stale

    def check_current(self, where: str) -> None:
        """Refuse (``SyncUsageError``) when a paired parameter was replaced since pairing."""
        stale = self.replaced()
        if stale:
            raise SyncUsageError(
                f"`{where}`: the parameters {stale[:3]}{' ...' if len(stale) > 3 else ''} were replaced since "
                "pair_parameters paired them (e.g. by load_state_dict(..., assign=True) or a new nn.Parameter), so a "
                "sync would copy between tensors the models no longer use and still report synced=True. Nothing "
                "was synced. Fix: load weights in place (load_state_dict without assign=True), or call close() on "
                "this ReferenceSync and build a new one from pair_parameters(policy, reference).")

    def sync(self, mix: float = 1.0) -> int:
        """Write this rank's shard of every policy parameter into the reference's (``mix`` 1: a copy; else
        ``ref = mix * policy + (1 - mix) * ref``, which needs the pairs to share their dtype). Gathers nothing and
        runs no collective.

        Returns:
            The bytes written on this rank.
        """
        mix = real_number("ParameterPairs.sync", "mix", mix, "pass mix in (0, 1]", low=0.0, high=1.0, low_open=True)
        if mix != 1.0:
            for name, policy, reference in self.pairs:
                if _shard(policy).dtype != _shard(reference).dtype:
                    raise refuse("ParameterPairs.sync", "mix", f"1.0 when a pair's dtypes differ (`{name}`: "
                                          f"{_shard(policy).dtype} into {_shard(reference).dtype})", mix,
                                          "build both models in one dtype for a soft update, or copy with mix=1.0")
        return sum(sync_pair(policy, reference, mix) for _, policy, reference in self.pairs)

    def shard_bytes(self) -> int:
        """The bytes of this rank's reference shards: what one sync writes (plus any ZeRO-3 whole copies)."""
        return sum(_nbytes(_shard(ref)) for _, _, ref in self.pairs)

    def reference_shards(self) -> dict:
        """``name -> a CPU copy of this rank's reference shard`` (checkpointing a reference that syncing moved)."""
        return {name: _shard(ref).detach().cpu().clone() for name, _, ref in self.pairs}

    def check_reference_shards(self, shards, where: str = "ParameterPairs.load_reference_shards",
                               finite: bool = True) -> None:
        """Refuse (``HumanlineStateError``) shards that ``load_reference_shards`` would not load exactly: not a dict of
        tensors, a name missing or extra, another shape or dtype (no silent cast), and with ``finite`` a NaN or
        infinite value."""
        fix = ("restore on the layout that saved them (the same models, dtype, ZeRO stage, number of processes and "
               "TP/PP sizes), each rank its own file, from a run whose reference stayed finite")
        if not isinstance(shards, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in
                                                   shards.items()):
            raise HumanlineStateError(f"`{where}`: the reference shards must be a dict of name -> tensor, got "
                                      f"{describe(shards)}. Nothing was loaded. Fix: {fix}.")
        names = [name for name, _, _ in self.pairs]
        missing, extra = [n for n in names if n not in shards], sorted(set(shards) - set(names))
        if missing or extra:
            raise HumanlineStateError(
                f"`{where}`: the saved reference shards do not name this pairing's parameters (missing "
                f"{missing[:3]}, not paired here {extra[:3]}). Nothing was loaded. Fix: {fix}.")
        for name, _, ref in self.pairs:
            local, saved = _shard(ref), shards[name]
            if tuple(saved.shape) != tuple(local.shape) or saved.dtype != local.dtype:
                raise HumanlineStateError(
                    f"`{where}`: the saved reference shards hold a {saved.dtype} {list(saved.shape)} for `{name}` "
                    f"where this rank's shard is {local.dtype} {list(local.shape)}. Nothing was loaded. Fix: {fix}.")
            if finite and saved.dtype.is_floating_point and not bool(torch.isfinite(saved).all()):
                raise HumanlineStateError(
                    f"`{where}`: the saved reference shard `{name}` holds NaN or infinite values. Nothing was "
                    f"loaded. Fix: {fix}.")

    @torch.no_grad()
    def load_reference_shards(self, shards: dict) -> None:
        """The inverse of ``reference_shards`` on the same layout (the same ZeRO stage, world size and TP/PP); every
        shard is checked first (``check_reference_shards``), so a refusal changes nothing.

        Raises:
            HumanlineStateError: a parameter missing or extra, another shape or dtype, a non-finite value.
        """
        self.check_reference_shards(shards)
        for name, _, ref in self.pairs:
            _shard(ref).data.copy_(shards[name].to(_shard(ref).device))
            if hasattr(ref, "ds_tensor") and _holds_whole(ref):
                ref.partition()  # the next forward gathers the loaded partition


def _checked_pairs(pairs) -> List[Pair]:
    """``pairs`` as a list, after the checks ``ParameterPairs`` documents."""
    where = "ParameterPairs()"
    if isinstance(pairs, ParameterPairs):
        return list(pairs.pairs)
    if isinstance(pairs, (str, bytes, torch.Tensor, torch.nn.Module)) or not hasattr(pairs, "__iter__"):
        raise refuse(where, "pairs", "a list of (name, policy tensor, reference tensor)", pairs, _PAIRS_FIX)
    out: List[Pair] = []
    names, references = set(), {}
    for item in pairs:
        if not (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], str)
                and all(isinstance(t, torch.Tensor) and t.dtype.is_floating_point for t in item[1:])):
            raise refuse(where, "pairs", "(name, policy tensor, reference tensor) triples of floating-point "
                                  "tensors", item, _PAIRS_FIX)
        name, policy, reference = item
        if name in names:
            raise refuse(where, "pairs", "triples with unique names", name, _PAIRS_FIX)
        if _same_storage(policy, reference):
            raise refuse(where, "pairs", f"a policy tensor and a distinct reference tensor (`{name}` pairs a "
                                  "tensor with itself, so every log-ratio would be 0)", policy, _PAIRS_FIX)
        if id(reference) in references:
            raise refuse(where, "pairs", f"each reference tensor in one pair (`{name}` and "
                                  f"`{references[id(reference)]}` write the same one)", reference, _PAIRS_FIX)
        if tuple(_shard(policy).shape) != tuple(_shard(reference).shape):
            raise refuse(where, "pairs", f"tensors whose local shards have one shape (`{name}`: "
                                  f"{list(_shard(policy).shape)} and {list(_shard(reference).shape)})", item,
                                  "build both models with one sharding layout")
        names.add(name)
        references[id(reference)] = name
        out.append((name, policy, reference))
    return out


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
        HumanlineUsageError: not two models (or two lists of chunks), their parameter names or local shapes differ,
            they are one model, or they share a parameter (every log-ratio would be 0).
    """
    where = "pair_parameters"
    for argument, models in (("policy", policy), ("reference", reference)):
        if not _is_models(models):
            raise refuse(where, argument, "an nn.Module (a DDP/FSDP2 module, a DeepSpeed engine) or a list of "
                                  "Megatron-core model chunks", models, _PAIRS_FIX)
    pol, ref = _named_parameters(policy), _named_parameters(reference)
    if [n for n, _ in pol] != [n for n, _ in ref]:
        only = sorted(set(n for n, _ in pol) ^ set(n for n, _ in ref))[:3]
        raise refuse(where, "reference", f"a model with the policy's parameter names, in order (they differ "
                              f"in names or order, e.g. {only})", reference, "pair two models built alike")
    for (name, p), (_, r) in zip(pol, ref):
        p_shape, r_shape = _shard(p).shape, _shard(r).shape
        if p_shape != r_shape:
            raise refuse(where, "reference", f"a model whose local shards have the policy's shapes (`{name}`: "
                                  f"the policy's local shard is {tuple(p_shape)} but the reference's is "
                                  f"{tuple(r_shape)})", reference, "build both models with one sharding layout")
        if _same_storage(p, r):
            raise refuse(where, "reference", f"a separate model (`{name}` is one tensor in both, so every "
                                  "log-ratio would be 0 and a sync would copy a tensor onto itself)", reference,
                                  "load or deepcopy a second model for the reference")
    models = list(policy) + list(reference) if not isinstance(policy, torch.nn.Module) else [policy, reference]
    return ParameterPairs([(name, p, r) for (name, p), (_, r) in zip(pol, ref)], models=models)


def _is_models(models) -> bool:
    """An ``nn.Module``, or a non-empty list/tuple of them (Megatron-core chunks)."""
    if isinstance(models, torch.nn.Module):
        return True
    return isinstance(models, (list, tuple)) and bool(models) and all(isinstance(m, torch.nn.Module) for m in models)


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

    Raises:
        HumanlineUsageError: no layer holds both adapters, their layouts differ, or the adapter names are equal.
    """
    where = "pair_lora_adapters"
    if not isinstance(model, torch.nn.Module):
        raise refuse(where, "model", "a PEFT model (an nn.Module)", model, "pass the PEFT model")
    for argument, value in (("policy_adapter", policy_adapter), ("reference_adapter", reference_adapter)):
        if not isinstance(value, str) or not value:
            raise refuse(where, argument, "an adapter name (a non-empty str)", value,
                                  "pass the adapters' names, e.g. \"default\" and \"reference\"")
    if policy_adapter == reference_adapter:
        raise refuse(where, "reference_adapter", "another adapter than `policy_adapter`", reference_adapter,
                              "add a frozen twin with model.add_adapter(\"reference\", config) and name it here")
    names = {id(p): n for n, p in _unwrap(model).named_parameters()}
    pairs, layouts_differ = [], False
    for layer in lora_layers(model):
        pol, ref = adapter_tensors(layer, policy_adapter), adapter_tensors(layer, reference_adapter)
        layouts_differ |= [n for n, _ in pol] != [n for n, _ in ref]
        pairs += [(names[id(r)], p, r) for (_, p), (_, r) in zip(pol, ref)]
    if not pairs:
        raise refuse(where, "model", f"a PEFT model where a layer holds both a `{policy_adapter}` and a "
                              f"`{reference_adapter}` LoRA adapter (no layer holds both)", model,
                              f"add the reference with model.add_adapter(\"{reference_adapter}\", config)")
    if layouts_differ:
        raise refuse(where, "model", f"a PEFT model whose `{policy_adapter}` and `{reference_adapter}` "
                              "adapters share one layout (they differ)", model,
                              "add the reference adapter with the policy adapter's LoraConfig")
    return ParameterPairs(pairs, models=[model])


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
