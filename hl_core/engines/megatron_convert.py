"""Hugging Face <-> megatron-core state dicts for Llama 3, Qwen 2.5 and Gemma 2, for any tp x pp layout.

``hf_to_mcore(hf, hf_config, tp, pp)`` returns ``{(pp_rank, tp_rank): local state dict}``: the names
each pipeline stage's ``GPTModel`` uses (layers numbered from 0 within the stage) and each tensor
sliced for its tensor-parallel rank. ``ranks=[(pp_rank, tp_rank)]`` converts only those shards, and
``hf`` may be any mapping; with ``LazyHFCheckpoint`` (safetensors) a rank reads from disk only its own
stage's tensors, and of those only its own tensor-parallel slice. ``mcore_to_hf(shards, hf_config, tp, pp)`` merges them
back. Every step is a view, a slice or a concatenation: the round trip is bit-exact.

The layouts (megatron-core, local spec):

* ``self_attention.linear_qkv``: per query group ``g``, that group's query heads, then its key
  head, then its value head (``[ng * (q_per_group + 2) * head_dim, hidden]``); tensor parallel
  splits it into contiguous blocks of whole groups. Qwen2's q/k/v biases follow the same layout.
* ``mlp.linear_fc1``: ``[gate; up]`` per TP rank, i.e. gate and up are split separately and each
  rank's halves concatenated.
* Column-parallel (split on dim 0): ``linear_qkv``, ``linear_fc1``, ``word_embeddings``,
  ``output_layer``. Row-parallel (dim 1): ``linear_proj``, ``linear_fc2``. Norms are replicated.
* Tied embeddings (Qwen2.5 small, Gemma 2): the HF checkpoint has no ``lm_head.weight``; with
  ``pp > 1`` the last stage holds its own ``output_layer.weight``, a copy of the embeddings.
* Gemma 2's extra norms: ``self_attention.post_layernorm`` (HF ``post_attention_layernorm``),
  ``pre_mlp_layernorm`` (HF ``pre_feedforward_layernorm``), ``mlp.post_layernorm`` (HF
  ``post_feedforward_layernorm``); norm weights are stored zero-centred as in HF.
* ``te=True``: the Transformer Engine spec's names, where the pre-attention / pre-MLP norms are fused
  into the following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).

mbridge (0.15.1) converts Llama and Qwen2 with the same layouts (the tests check that it agrees
tensor for tensor); it has no Gemma 2 bridge and needs live, distributed model shards, while this
module is pure tensor code and also serves the save-time merge.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .megatron_specs import model_family

Shards = Dict[Tuple[int, int], Dict[str, torch.Tensor]]

COLUMN = "column"
ROW = "row"
REPLICATED = "replicated"
QKV = "qkv"
FC1 = "fc1"


def _dims(hf_config):
    heads = hf_config.num_attention_heads
    groups = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, groups, head_dim


def tied(hf_config) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def stage_layers(num_layers: int, pp: int, pp_rank: int) -> range:
    """Global layer indices on pipeline stage ``pp_rank`` (megatron-core's even split)."""
    per = num_layers // pp
    return range(pp_rank * per, (pp_rank + 1) * per)


def layer_mapping(hf_config, te: bool = False) -> List[Tuple[str, List[str], str]]:
    """``(mcore suffix, [HF names with {i}], kind)`` for one decoder layer."""
    family = model_family(hf_config)
    p = "model.layers.{i}."
    attn_norm = "self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
    rows = [
        (attn_norm, [p + "input_layernorm.weight"], REPLICATED),
        ("self_attention.linear_qkv.weight", [p + f"self_attn.{x}_proj.weight" for x in "qkv"], QKV),
        ("self_attention.linear_proj.weight", [p + "self_attn.o_proj.weight"], ROW),
        ("mlp.linear_fc1.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], FC1),
        ("mlp.linear_fc2.weight", [p + "mlp.down_proj.weight"], ROW),
    ]
    if family == "qwen2":
        rows.append(("self_attention.linear_qkv.bias", [p + f"self_attn.{x}_proj.bias" for x in "qkv"], QKV))
    if family == "gemma2":
        rows += [
            ("self_attention.post_layernorm.weight", [p + "post_attention_layernorm.weight"], REPLICATED),
            (mlp_norm, [p + "pre_feedforward_layernorm.weight"], REPLICATED),
            ("mlp.post_layernorm.weight", [p + "post_feedforward_layernorm.weight"], REPLICATED),
        ]
    else:
        rows.append((mlp_norm, [p + "post_attention_layernorm.weight"], REPLICATED))
    return rows


def _stage_entries(hf_config, pp: int, pp_rank: int, te: bool):
    """``(local mcore name, [HF names], kind)`` for every tensor on stage ``pp_rank``."""
    entries = []
    if pp_rank == 0:
        entries.append(("embedding.word_embeddings.weight", ["model.embed_tokens.weight"], COLUMN))
    for local, i in enumerate(stage_layers(hf_config.num_hidden_layers, pp, pp_rank)):
        for suffix, hf_names, kind in layer_mapping(hf_config, te):
            entries.append((f"decoder.layers.{local}.{suffix}", [n.format(i=i) for n in hf_names], kind))
    if pp_rank == pp - 1:
        entries.append(("decoder.final_layernorm.weight", ["model.norm.weight"], REPLICATED))
        if not tied(hf_config):
            entries.append(("output_layer.weight", ["lm_head.weight"], COLUMN))
        elif pp > 1:
            entries.append(("output_layer.weight", ["model.embed_tokens.weight"], COLUMN))
    return entries


# ------------------------------------------------------------------------------------------------
# one tensor: HF pieces -> full mcore tensor -> TP shards, and back
# ------------------------------------------------------------------------------------------------


def _qkv_merge(hf_config, q, k, v):
    """q/k/v rows of some whole query groups -> megatron-core's per-group [q; k; v] layout."""
    heads, groups, head_dim = _dims(hf_config)
    q_rows = heads // groups * head_dim
    tail = q.shape[1:]
    local_groups = k.shape[0] // head_dim
    qkv = torch.cat([
        q.reshape(local_groups, q_rows, *tail),
        k.reshape(local_groups, head_dim, *tail),
        v.reshape(local_groups, head_dim, *tail),
    ], dim=1)
    return qkv.reshape(-1, *tail)


def _qkv_split(hf_config, qkv):
    heads, groups, head_dim = _dims(hf_config)
    q_rows = heads // groups * head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, q_rows + 2 * head_dim, *tail)
    q, k, v = grouped.split([q_rows, head_dim, head_dim], dim=1)
    return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]


def _read(hf, name: str, dim: Optional[int] = None, part: int = 0, parts: int = 1) -> torch.Tensor:
    """``hf[name]``, or its ``part``-th of ``parts`` equal slices along ``dim``; a ``LazyHFCheckpoint``
    reads only that slice from disk."""
    if dim is None or parts == 1:
        return hf[name]
    if isinstance(hf, LazyHFCheckpoint):
        return hf.read_slice(name, dim, part, parts)
    tensor = hf[name]
    size = tensor.shape[dim]
    if size % parts:
        raise ValueError(f"`{name}` has {size} rows along dim {dim}, not divisible into {parts} tensor-parallel parts")
    return tensor.narrow(dim, part * (size // parts), size // parts)


def _shard(hf, hf_config, kind: str, names: List[str], tp: int, t: int) -> torch.Tensor:
    """Tensor-parallel rank ``t``'s piece of one megatron-core tensor, reading only what it needs."""
    if kind == REPLICATED:
        return _read(hf, names[0])
    if kind == COLUMN:
        return _read(hf, names[0], 0, t, tp)
    if kind == ROW:
        return _read(hf, names[0], 1, t, tp)
    if kind == QKV:  # whole query groups per rank: contiguous rows of each of q, k and v
        return _qkv_merge(hf_config, *(_read(hf, n, 0, t, tp) for n in names))
    if kind == FC1:  # [gate; up], each split on its own
        return torch.cat([_read(hf, names[0], 0, t, tp), _read(hf, names[1], 0, t, tp)], dim=0)
    raise ValueError(kind)


def _from_shards(hf_config, kind: str, shards: List[torch.Tensor]) -> List[torch.Tensor]:
    if kind == REPLICATED:
        return [shards[0]]
    if kind == COLUMN:
        return [torch.cat(shards, dim=0)]
    if kind == ROW:
        return [torch.cat(shards, dim=1)]
    if kind == QKV:
        return _qkv_split(hf_config, torch.cat(shards, dim=0))
    if kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------
# whole models
# ------------------------------------------------------------------------------------------------


def hf_to_mcore(
    hf: Mapping[str, torch.Tensor], hf_config, tp: int = 1, pp: int = 1, *,
    ranks: Optional[Iterable[Tuple[int, int]]] = None, te: bool = False,
) -> Shards:
    """HF state dict -> ``{(pp_rank, tp_rank): megatron-core local state dict}`` (contiguous clones)."""
    wanted = sorted(set(ranks)) if ranks is not None else [(p, t) for p in range(pp) for t in range(tp)]
    out: Shards = {r: {} for r in wanted}
    for pp_rank, t in wanted:
        for name, hf_names, kind in _stage_entries(hf_config, pp, pp_rank, te):
            out[(pp_rank, t)][name] = _shard(hf, hf_config, kind, hf_names, tp, t).contiguous().clone()
    return out


def mcore_to_hf(shards: Mapping[Tuple[int, int], Mapping[str, torch.Tensor]], hf_config, tp: int, pp: int, *,
                te: bool = False) -> Dict[str, torch.Tensor]:
    """Merge all ``(pp_rank, tp_rank)`` shards into an HF state dict (tied models: no ``lm_head.weight``)."""
    missing = [(p, t) for p in range(pp) for t in range(tp) if (p, t) not in shards]
    if missing:
        raise ValueError(f"missing shards {missing} for tp={tp}, pp={pp}")
    hf: Dict[str, torch.Tensor] = {}
    for pp_rank in range(pp):
        for name, hf_names, kind in _stage_entries(hf_config, pp, pp_rank, te):
            if name == "output_layer.weight" and tied(hf_config):
                continue  # the last stage's copy of the tied embeddings
            pieces = _from_shards(hf_config, kind, [shards[(pp_rank, t)][name] for t in range(tp)])
            for hf_name, piece in zip(hf_names, pieces):
                hf[hf_name] = piece.contiguous()
    return hf


def hf_state_dict(model) -> Dict[str, torch.Tensor]:
    """A HF model's weights as its checkpoint holds them (tied ``lm_head.weight`` dropped)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if tied(model.config):
        sd.pop("lm_head.weight", None)
    return sd


class LazyHFCheckpoint(Mapping):
    """Read-only mapping over a HF model directory's safetensors; tensors are read when asked for."""

    def __init__(self, directory: str):
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = [p.name for p in sorted(directory.glob("*.safetensors"))]
            if not files:
                raise FileNotFoundError(f"no *.safetensors in {directory}")
            weight_map = None
        self._handles = {f: safe_open(str(directory / f), framework="pt", device="cpu") for f in files}
        if weight_map is None:
            weight_map = {k: f for f, h in self._handles.items() for k in h.keys()}
        self._where = weight_map

    def __getitem__(self, key):
        return self._handles[self._where[key]].get_tensor(key)

    def read_slice(self, key: str, dim: int, part: int, parts: int) -> torch.Tensor:
        """The ``part``-th of ``parts`` equal slices of tensor ``key`` along ``dim`` (read from disk alone)."""
        view = self._handles[self._where[key]].get_slice(key)
        shape = view.get_shape()
        if shape[dim] % parts:
            raise ValueError(f"`{key}` has {shape[dim]} rows along dim {dim}, not divisible into {parts} "
                             f"tensor-parallel parts")
        size = shape[dim] // parts
        index = tuple(slice(part * size, (part + 1) * size) if d == dim else slice(None) for d in range(len(shape)))
        return view[index]

    def __iter__(self):
        return iter(self._where)

    def __len__(self):
        return len(self._where)


def save_hf_directory(hf: Dict[str, torch.Tensor], hf_config, directory: str, tokenizer=None,
                      max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a HF model directory (sharded safetensors + index when large, config, tokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = list(hf)
    shards, current, size = [], [], 0
    for name in names:
        nbytes = hf[name].numel() * hf[name].element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file({n: hf[n].contiguous() for n in shards[0]}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, group in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: hf[n].contiguous() for n in group}, str(directory / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        total = sum(t.numel() * t.element_size() for t in hf.values())
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    hf_config = copy.deepcopy(hf_config)
    hf_config.dtype = next(iter(hf.values())).dtype  # recorded as the checkpoint's dtype
    hf_config.save_pretrained(str(directory))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
