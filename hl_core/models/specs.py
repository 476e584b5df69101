"""Architecture dimensions of the models our recipes name, so `--validate` and `--plan` need no hub access.

``resolve_spec(recipe.model)`` returns a `ModelSpec`: from the model directory's ``config.json``
when ``model.name_or_path`` is a local directory, from the table below for the Hugging Face names our
recipes use, or from a ``config.json`` already in the local Hugging Face cache (never downloading).
``model.config_overrides`` is applied on top. ``check_layout(recipe, world_size)`` checks the parallel
layout (tp/pp against heads and layers, world size, batch divisibility, ZeRO vs. engine) and raises
``RecipeError`` with one paragraph naming the key and the fix.

The table is copied from each model's public ``config.json``; ``tests/test_plan.py`` instantiates every
entry on the meta device with transformers and checks ``num_params()`` and ``largest_layer_params()``
against the real module tree.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from ..config import batch_layout
from ..errors import RecipeError, did_you_mean
from ..storage import gguf_models

REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer dimensions (Llama / Qwen2 / Gemma 2 family)."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    intermediate_size: int
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on q, k, v projections
    o_bias: bool = False  # Llama `attention_bias`: biases on q, k, v and o
    mlp_bias: bool = False
    norms_per_layer: int = 2  # RMSNorm weights per decoder layer (Gemma 2: 4)
    max_position_embeddings: Optional[int] = None
    source: str = "table"  # "table", a config.json path, or "hf-cache"

    # -------------------------------------------------------------------------------------- counts
    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.kv_channels

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.kv_channels

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def lm_head_params(self) -> int:
        """Output projection parameters that are not shared with the embedding (0 when tied)."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    def attention_params(self) -> int:
        h, q, kv = self.hidden_size, self.q_dim, self.kv_dim
        n = h * q + 2 * h * kv + q * h  # q, k, v, o projections
        if self.qkv_bias or self.o_bias:
            n += q + 2 * kv
        if self.o_bias:
            n += h
        return n

    def mlp_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        n = 3 * h * i  # gate, up, down (SwiGLU / GeGLU)
        if self.mlp_bias:
            n += 2 * i + h
        return n

    def layer_matrices(self) -> List[int]:
        """Elements of one decoder layer's weight matrices, in the model's order: q, k, v, o, gate, up, down."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h]

    def layer_vectors(self) -> List[int]:
        """Elements of one decoder layer's biases (q, k, v[, o]; gate, up, down) and norms; with
        `layer_matrices`, every parameter tensor of the layer (their sums add up to `layer_params`)."""
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        biases = ([q, kv, kv] if self.qkv_bias or self.o_bias else []) + ([h] if self.o_bias else [])
        biases += [i, i, h] if self.mlp_bias else []
        return biases + [h] * self.norms_per_layer

    def layer_params(self) -> int:
        return self.attention_params() + self.mlp_params() + self.norms_per_layer * self.hidden_size

    def num_params(self) -> int:
        """Unique parameters: embedding + L x layer + final norm + untied lm_head.

        Per layer: ``h*q + 2*h*kv + q*h`` (attention, ``q = heads*head_dim``, ``kv = kv_heads*head_dim``)
        [+ ``q + 2*kv`` biases for Qwen2] + ``3*h*I`` (gated MLP) + ``norms_per_layer*h``.
        """
        return (
            self.embedding_params()
            + self.num_layers * self.layer_params()
            + self.hidden_size
            + self.lm_head_params()
        )

    def largest_layer_params(self) -> int:
        """Parameters of the largest single module (what DeepSpeed's ZeRO-3 estimator calls a layer):
        the embedding (or lm_head) for all our models, else the largest MLP projection."""
        h, i = self.hidden_size, self.intermediate_size
        candidates = [
            self.vocab_size * h,
            h * i + (i if self.mlp_bias else 0),
            h * self.q_dim + (self.q_dim if (self.qkv_bias or self.o_bias) else 0),
        ]
        return max(candidates)

    def with_overrides(self, overrides: Mapping[str, Any]) -> "ModelSpec":
        fields = {}
        for key, value in (overrides or {}).items():
            target = _HF_KEYS.get(key)
            if target is not None and value is not None:
                fields[target] = value
        return dataclasses.replace(self, **fields) if fields else self

    def describe(self) -> str:
        return (
            f"{self.name}: {self.num_params() / 1e9:.2f}B params, hidden {self.hidden_size}, {self.num_layers} layers, "
            f"{self.num_heads} heads ({self.num_kv_heads} KV, head_dim {self.kv_channels}), vocab {self.vocab_size}, "
            f"intermediate {self.intermediate_size}, tied embeddings {self.tie_word_embeddings}"
        )


# config.json key -> ModelSpec field
_HF_KEYS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
    "head_dim": "head_dim",
    "tie_word_embeddings": "tie_word_embeddings",
    "attention_bias": "o_bias",
    "mlp_bias": "mlp_bias",
    "max_position_embeddings": "max_position_embeddings",
}

# transformers' per-architecture default for `tie_word_embeddings` when config.json omits it
_TIE_DEFAULTS = {"llama": False, "mistral": False, "qwen2": False, "qwen3": False, "gemma": True, "gemma2": True}


def _llama3_8b(name: str, max_pos: int) -> ModelSpec:
    return ModelSpec(
        name=name, model_type="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        vocab_size=128256, intermediate_size=14336, head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=max_pos,
    )


# From each model's public config.json.
MODEL_SPECS: Dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _llama3_8b("meta-llama/Meta-Llama-3-8B-Instruct", 8192),
        _llama3_8b("meta-llama/Llama-3.1-8B-Instruct", 131072),
        ModelSpec(
            name="meta-llama/Llama-3.2-1B-Instruct", model_type="llama", hidden_size=2048, num_layers=16, num_heads=32,
            num_kv_heads=8, vocab_size=128256, intermediate_size=8192, head_dim=64, tie_word_embeddings=True,
            max_position_embeddings=131072,
        ),
        ModelSpec(
            name="Qwen/Qwen2.5-1.5B-Instruct", model_type="qwen2", hidden_size=1536, num_layers=28, num_heads=12,
            num_kv_heads=2, vocab_size=151936, intermediate_size=8960, tie_word_embeddings=True, qkv_bias=True,
            max_position_embeddings=32768,
        ),
        ModelSpec(
            name="Qwen/Qwen2.5-7B-Instruct", model_type="qwen2", hidden_size=3584, num_layers=28, num_heads=28,
            num_kv_heads=4, vocab_size=152064, intermediate_size=18944, tie_word_embeddings=False, qkv_bias=True,
            max_position_embeddings=32768,
        ),
        ModelSpec(
            name="google/gemma-2-9b-it", model_type="gemma2", hidden_size=3584, num_layers=42, num_heads=16,
            num_kv_heads=8, vocab_size=256000, intermediate_size=14336, head_dim=256, tie_word_embeddings=True,
            norms_per_layer=4, max_position_embeddings=8192,
        ),
        ModelSpec(
            name="google/gemma-2-27b-it", model_type="gemma2", hidden_size=4608, num_layers=46, num_heads=32,
            num_kv_heads=16, vocab_size=256000, intermediate_size=36864, head_dim=128, tie_word_embeddings=True,
            norms_per_layer=4, max_position_embeddings=8192,
        ),
    )
}
# The base (non-instruct) checkpoints share the dimensions.
for _name, _base in (
    ("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B-Instruct"),
    ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct"),
    ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-3.2-1B-Instruct"),
    ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-1.5B-Instruct"),
    ("Qwen/Qwen2.5-7B", "Qwen/Qwen2.5-7B-Instruct"),
    ("google/gemma-2-9b", "google/gemma-2-9b-it"),
    ("google/gemma-2-27b", "google/gemma-2-27b-it"),
):
    MODEL_SPECS[_name] = dataclasses.replace(MODEL_SPECS[_base], name=_name)


def spec_from_config(config: Mapping[str, Any], name: str = "local", source: str = "config.json") -> ModelSpec:
    """A `ModelSpec` from a Hugging Face ``config.json`` mapping (``text_config`` is used when present)."""
    if isinstance(config.get("text_config"), Mapping):
        outer_tie = config.get("tie_word_embeddings")
        config = dict(config["text_config"], **({"tie_word_embeddings": outer_tie} if outer_tie is not None else {}))
    model_type = str(config.get("model_type", "llama"))
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")
               if k not in config]
    if missing:
        raise RecipeError(
            f"`model.name_or_path`: {source} lacks {', '.join(missing)}, so the memory plan and layout checks cannot "
            "size the model. Fix: use a decoder-only Hugging Face config.json with those keys."
        )
    heads = int(config["num_attention_heads"])
    qwen = model_type.startswith("qwen2")
    return ModelSpec(
        name=name,
        model_type=model_type,
        hidden_size=int(config["hidden_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        intermediate_size=int(config["intermediate_size"]),
        head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", _TIE_DEFAULTS.get(model_type, True))),
        qkv_bias=qwen,
        o_bias=bool(config.get("attention_bias", False)) and not qwen,
        mlp_bias=bool(config.get("mlp_bias", False)),
        norms_per_layer=4 if model_type.startswith(("gemma2", "gemma3")) else 2,
        max_position_embeddings=config.get("max_position_embeddings"),
        source=source,
    )


def _local_dir(name_or_path: str) -> Optional[Path]:
    for base in (Path.cwd(), REPO_ROOT):
        path = (base / name_or_path).expanduser()
        if path.is_dir():
            return path
    return None


def _hf_cache_config(name: str) -> Optional[Path]:
    """``config.json`` of ``name`` if it is already in the local Hugging Face cache (no network)."""
    if name.count("/") != 1:
        return None
    try:
        from huggingface_hub import (
            try_to_load_from_cache,  # imported here: only a hub name needs it
        )
    except ImportError:  # pragma: no cover
        return None
    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # invalid repo id etc.
        return None
    return Path(found) if isinstance(found, str) else None


def resolve_spec(model) -> ModelSpec:
    """The dimensions of ``model`` (a recipe's ``model:`` group, or a name/path string); never downloads."""
    name = model if isinstance(model, str) else model.name_or_path
    overrides = {} if isinstance(model, str) else dict(model.config_overrides or {})
    local = _local_dir(name)
    if gguf_models.is_gguf_reference(name):  # its converted config.json, or before converting, the file's header
        spec = spec_from_config(gguf_models.hf_config(name), name=name, source=name)
    elif local is not None:
        cfg = local / "config.json"
        if not cfg.exists():
            raise RecipeError(
                f"`model.name_or_path: {name}` is a directory without a config.json, so its size is unknown. "
                "Fix: put the model's config.json there (plus weights unless `model.random_init: true`)."
            )
        try:
            data = json.loads(cfg.read_text())
        except json.JSONDecodeError as exc:
            raise RecipeError(f"`model.name_or_path`: {cfg} is not valid JSON ({exc}). Fix: repair the file.")
        spec = spec_from_config(data, name=name, source=str(cfg))
    elif name in MODEL_SPECS:
        spec = MODEL_SPECS[name]
    else:
        cached = _hf_cache_config(name)
        if cached is None:
            raise RecipeError(
                f"`model.name_or_path: {name}` is not a local model directory and not a model whose dimensions "
                f"ship with the pack.{did_you_mean(name, MODEL_SPECS)} Fix: point it at a local directory with the "
                "model's config.json, or add an entry for it to `MODEL_SPECS` in hl_core/models/specs.py "
                "(hidden size, layers, heads, KV heads, vocab, intermediate size from its config.json)."
            )
        spec = spec_from_config(json.loads(cached.read_text()), name=name, source="hf-cache")
    return spec.with_overrides(overrides)


# ------------------------------------------------------------------------------------------------
# Layout checks
# ------------------------------------------------------------------------------------------------


def check_layout(recipe, world_size: int) -> None:
    """Parallel-layout checks for ``world_size`` processes; raises ``RecipeError`` naming the key and the fix."""
    spec = resolve_spec(recipe.model)
    tp, pp = recipe.parallel.tp, recipe.parallel.pp
    engine = recipe.engine.name
    if world_size < 1:
        raise RecipeError(f"world size {world_size} must be at least 1. Fix: launch at least one process.")
    if engine == "megatron" and recipe.engine.zero_stage != 0:
        raise RecipeError(
            f"`engine.zero_stage: {recipe.engine.zero_stage}` is invalid with `engine.name: megatron`: ZeRO is a "
            "DeepSpeed setting and Megatron would ignore it (it shards optimizer states with its distributed "
            "optimizer across data-parallel ranks instead). Fix: set `engine.zero_stage=0`, or use "
            "`engine.name=deepspeed`."
        )
    if spec.num_heads % tp:
        raise RecipeError(
            f"`parallel.tp: {tp}` does not divide the {spec.num_heads} attention heads of `{spec.name}`. "
            f"Fix: choose `parallel.tp` among {_divisors(spec.num_heads, spec.num_kv_heads)}."
        )
    if spec.num_kv_heads % tp:
        raise RecipeError(
            f"`parallel.tp: {tp}` does not divide the {spec.num_kv_heads} key/value heads of `{spec.name}` "
            "(grouped-query attention shards whole KV groups). "
            f"Fix: choose `parallel.tp` among {_divisors(spec.num_heads, spec.num_kv_heads)}."
        )
    if spec.num_layers % pp:
        raise RecipeError(
            f"`parallel.pp: {pp}` does not divide the {spec.num_layers} layers of `{spec.name}` (each pipeline "
            f"stage gets the same number of layers). Fix: choose `parallel.pp` among {_divisors(spec.num_layers)}."
        )
    if world_size % (tp * pp):
        raise RecipeError(
            f"world size {world_size} is not a multiple of `parallel.tp` x `parallel.pp` = {tp} x {pp} = {tp * pp}, "
            "so the data-parallel size dp = world / (tp x pp) is not a whole number. Fix: change the number of "
            "processes (`cluster.nodes` x `cluster.gpus_per_node`) or the parallel layout."
        )
    batch_layout(recipe, world_size)  # global batch vs. micro batch x dp (RecipeError with the fix)


def _divisors(*numbers: int) -> str:
    common = [d for d in range(1, max(numbers) + 1) if all(n % d == 0 for n in numbers)]
    return ", ".join(map(str, common))
