"""Megatron-core models for the Hugging Face families in our recipes: Llama 3, Qwen 2.5 and Gemma 2.

* ``transformer_config(hf_config, ...)``: the ``TransformerConfig`` that reproduces the HF model.
* ``build_gpt_model(hf_config, config, pre_process, post_process)``: one pipeline stage of the
  model. Llama and Qwen2 use megatron-core's own layer specs (Transformer Engine's when it is
  installed and a GPU is present, the local spec otherwise). Gemma 2 has its own local spec here.
* ``logits_transform(config)``: the element-wise map applied to the output layer's logits (Gemma 2's
  final soft-capping), ``None`` for the others.

Gemma 2 differs from Llama in ways megatron-core's local spec cannot express, so it gets:
``GemmaRMSNorm`` (``x_hat * (1 + w)`` computed in float32, weights stored zero-centred as in HF),
a post-attention and a post-MLP norm (``Gemma2SelfAttention`` / ``Gemma2MLP`` apply them to their
outputs, before the residual add), ``Gemma2CoreAttention`` (scale ``query_pre_attn_scalar**-0.5``,
``tanh`` soft-capping of the attention scores, a sliding window on the layers HF marks
``sliding_attention``), the embeddings scaled by ``sqrt(hidden_size)``, a gated tanh-GELU MLP and
tied input/output embeddings.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F

from ..errors import RecipeError
from .megatron_cpu import CPU_CONFIG_FLAGS

# Imports inside functions: megatron-core is an optional extra and heavy; it loads when a megatron model is built.

FAMILIES = ("llama", "qwen2", "gemma2")


def model_family(hf_config) -> str:
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise RecipeError(
            f"`engine.name: megatron` supports the model families {', '.join(FAMILIES)}; this model is "
            f"`{family}`. Fix: use `engine.name=deepspeed` for it."
        )
    return family


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """``gelu_pytorch_tanh`` (Gemma's ``hidden_activation``)."""
    return F.gelu(x, approximate="tanh")


def _rope(hf_config) -> dict:
    """GPTModel rotary arguments from the HF config (transformers 5 ``rope_parameters`` or legacy keys)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    legacy = getattr(hf_config, "rope_scaling", None) or {}
    params = {**legacy, **params}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    args = dict(position_embedding_type="rope", rotary_base=theta, rotary_percent=1.0)
    if rope_type == "default":
        return args
    if rope_type == "llama3":
        expected = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
        if all(float(params.get(k, v)) == float(v) for k, v in expected.items()):
            return {**args, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise RecipeError(
        f"RoPE type `{rope_type}` with parameters {params} has no exact megatron-core equivalent here "
        "(supported: default, and llama3 with low/high frequency factors 1/4 over 8192 positions). "
        "Fix: use `engine.name=deepspeed` for this model."
    )


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


def _gemma2_config_class():
    from megatron.core.transformer import TransformerConfig

    @dataclass
    class Gemma2TransformerConfig(TransformerConfig):
        """``TransformerConfig`` plus Gemma 2's soft-capping, sliding window and embedding scale."""

        attn_logit_softcapping: Optional[float] = None
        final_logit_softcapping: Optional[float] = None
        sliding_window: Optional[int] = None
        sliding_layers: Tuple[int, ...] = field(default_factory=tuple)  # 0-based global layer indices
        embedding_multiplier: float = 1.0

    return Gemma2TransformerConfig


_GEMMA2_CONFIG = None


def transformer_config(hf_config, *, tp: int, pp: int, dtype: torch.dtype, cpu: bool, **overrides):
    """The megatron-core config reproducing ``hf_config`` (dropout from the HF config)."""
    global _GEMMA2_CONFIG
    from megatron.core.transformer import TransformerConfig


    family = model_family(hf_config)
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if hf_config.num_hidden_layers % pp:
        raise RecipeError(
            f"`parallel.pp={pp}` must divide the model's {hf_config.num_hidden_layers} layers. Fix: choose another "
            f"`parallel.pp`."
        )
    if kv_heads % tp or hf_config.vocab_size % tp:
        raise RecipeError(
            f"`parallel.tp={tp}` must divide the number of key/value heads ({kv_heads}) and the vocabulary "
            f"({hf_config.vocab_size}). Fix: choose another `parallel.tp`."
        )
    if family == "llama" and (getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False)):
        raise RecipeError("Llama models with `attention_bias`/`mlp_bias` are not supported by the megatron engine.")
    if family == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise RecipeError("Qwen2 with `use_sliding_window: true` is not supported by the megatron engine.")
    kwargs = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=family == "qwen2",
        hidden_dropout=float(getattr(hf_config, "hidden_dropout", 0.0) or 0.0),
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        attention_softmax_in_fp32=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=cpu,
    )
    kwargs.update(CPU_CONFIG_FLAGS if cpu else fusions_without_kernels())
    cls = TransformerConfig
    if family == "gemma2":
        if _GEMMA2_CONFIG is None:
            _GEMMA2_CONFIG = _gemma2_config_class()
        cls = _GEMMA2_CONFIG
        layer_types = getattr(hf_config, "layer_types", None) or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(hf_config.num_hidden_layers)
        ]
        kwargs.update(
            activation_func=gelu_tanh,
            softmax_scale=hf_config.query_pre_attn_scalar ** -0.5,
            attn_logit_softcapping=hf_config.attn_logit_softcapping,
            final_logit_softcapping=hf_config.final_logit_softcapping,
            sliding_window=hf_config.sliding_window,
            sliding_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
            embedding_multiplier=hf_config.hidden_size ** 0.5,
        )
    kwargs.update(overrides)
    return cls(**kwargs)


# ------------------------------------------------------------------------------------------------
# Gemma 2 modules
# ------------------------------------------------------------------------------------------------


class GemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: ``(x / rms(x)) * (1 + w)`` in float32, cast back; ``w`` starts at zero."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        dtype = config.params_dtype if config is not None else torch.float32
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def _gemma2_modules():
    """Gemma 2 classes subclassing megatron-core's: the core attention, self-attention, MLP and model."""
    return (_gemma2_core_attention(), *_gemma2_norm_wrappers())


def _gemma2_core_attention():
    """Gemma 2's core attention on megatron-core's module (imported lazily: megatron is optional)."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.utils import divide

    class Gemma2CoreAttention(MegatronModule):
        """Eager attention with Gemma 2's score soft-capping and sliding window.

        ``query [sq, b, np, hn]``, ``key``/``value`` ``[sk, b, ng, hn]`` (this rank's heads),
        ``attention_mask``: boolean, True = masked (the causal mask), broadcast over ``[b, np]``.
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.layer_number = max(1, layer_number)
            self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5
            self.softcap = config.attn_logit_softcapping
            self.window = config.sliding_window if (self.layer_number - 1) in config.sliding_layers else None
            tp = config.tensor_model_parallel_size
            self.heads_per_partition = divide(config.num_attention_heads, tp)
            dropout = config.attention_dropout if attention_dropout is None else attention_dropout
            self.dropout = torch.nn.Dropout(dropout)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            assert packed_seq_params is None and attention_bias is None
            groups = key.size(2)
            if query.size(2) != groups:
                key = key.repeat_interleave(query.size(2) // groups, dim=2)
                value = value.repeat_interleave(query.size(2) // groups, dim=2)
            sq, b, heads, hn = query.shape
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, np, s, hn]
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            sk = k.size(2)
            mask = attention_mask
            if mask is None:
                mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
            if self.window is not None:
                pos_q = torch.arange(sk - sq, sk, device=q.device)[:, None]
                pos_k = torch.arange(sk, device=q.device)[None, :]
                mask = mask | (pos_k <= pos_q - self.window)
            scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = self.dropout(probs)
            context = torch.matmul(probs, v)  # [b, np, sq, hn]
            return context.permute(2, 0, 1, 3).reshape(sq, b, heads * hn)

    return Gemma2CoreAttention


def _gemma2_norm_wrappers():
    """Gemma 2's self-attention and MLP (their outputs through Gemma's extra norms) and its model (the embedding
    scale), subclassing megatron-core's (imported lazily: megatron is optional)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.mlp import MLP

    class Gemma2SelfAttention(SelfAttention):
        """Self-attention whose output goes through Gemma's post-attention norm (before the residual)."""

        def __init__(self, config, submodules, layer_number, attn_mask_type, **kwargs):
            super().__init__(config, submodules, layer_number, attn_mask_type=attn_mask_type, **kwargs)
            self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, config.layernorm_epsilon)

        def forward(self, *args, **kwargs):
            output, bias = super().forward(*args, **kwargs)
            assert bias is None, "Gemma 2 has no output-projection bias"
            return self.post_layernorm(output), None

    class Gemma2MLP(MLP):
        """Gated MLP whose output goes through Gemma's post-feed-forward norm (before the residual)."""

        def __init__(self, config, submodules, **kwargs):
            super().__init__(config, submodules, **kwargs)
            self.post_layernorm = GemmaRMSNorm(config, config.hidden_size, config.layernorm_epsilon)

        def forward(self, hidden_states, *args, **kwargs):
            output, bias = super().forward(hidden_states, *args, **kwargs)
            assert bias is None, "Gemma 2 has no MLP bias"
            return self.post_layernorm(output), None

    class Gemma2GPTModel(GPTModel):
        """GPTModel with Gemma's embedding scale (``sqrt(hidden_size)``, rounded to the parameter dtype)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.pre_process:
                self.embedding.register_forward_hook(self._scale_embeddings)

        def _scale_embeddings(self, module, inputs, output):
            return output * torch.tensor(self.config.embedding_multiplier, dtype=output.dtype)

    return Gemma2SelfAttention, Gemma2MLP, Gemma2GPTModel


def gemma2_block_spec(config, pp_rank: Optional[int] = None):
    """Block spec (local layers of this pipeline stage) for Gemma 2: local megatron-core linears,
    Gemma's norms, attention and MLP."""
    from megatron.core.models.gpt.gpt_layer_specs import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    core, self_attention, mlp, _ = _gemma2_modules()
    layer = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=GemmaRMSNorm,
            self_attention=ModuleSpec(
                module=self_attention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear, core_attention=core, linear_proj=RowParallelLinear,
                    q_layernorm=IdentityOp, k_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=GemmaRMSNorm,
            mlp=ModuleSpec(module=mlp,
                           submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)),
            mlp_bda=get_bias_dropout_add,
        ),
    )
    n = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=GemmaRMSNorm)


def transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def fusions_without_kernels() -> dict:
    """GPU: the megatron-core fusions to switch off because their compiled kernels are not installed
    (the fused masked softmax ships with Apex or Megatron-LM's build, the weight-gradient fusion with Apex,
    the rotary fusion with Transformer Engine); megatron-core asks for the softmax one by default and would
    fail at the first forward without it."""
    def missing(module: str) -> bool:
        return importlib.util.find_spec(module) is None

    flags = {}
    if missing("scaled_upper_triang_masked_softmax_cuda") or missing("scaled_masked_softmax_cuda"):
        flags["masked_softmax_fusion"] = False
    if missing("fused_weight_gradient_mlp_cuda"):
        flags["gradient_accumulation_fusion"] = False
    if missing("apex"):
        flags["persist_layer_norm"] = False
    if not transformer_engine_available():
        flags["apply_rope_fusion"] = False
    return flags


def uses_transformer_engine(hf_config) -> bool:
    """TE layer spec: Llama/Qwen2 on a GPU with Transformer Engine installed. Gemma 2 always uses
    its own local spec (TE's attention has no score soft-capping)."""
    return model_family(hf_config) != "gemma2" and transformer_engine_available()


def build_gpt_model(hf_config, config, pre_process: bool, post_process: bool, pp_rank: Optional[int] = None):
    """One pipeline stage of the megatron-core model for ``hf_config`` (random init; load weights after)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    family = model_family(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    common = dict(
        config=config, vocab_size=hf_config.vocab_size, max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process, post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=tied, **_rope(hf_config),
    )
    if family == "gemma2":
        *_, gemma_model = _gemma2_modules()
        return gemma_model(transformer_layer_spec=gemma2_block_spec(config, pp_rank), **common)
    te = uses_transformer_engine(hf_config)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm", pp_rank=pp_rank)
    if not te:
        from .megatron_attention import use_sdpa_attention  # imported here: it imports megatron-core at load

        use_sdpa_attention(spec)  # fused attention without Transformer Engine (scores never stored)
    return GPTModel(transformer_layer_spec=spec, **common)


def logits_transform(config) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """Element-wise map on the output logits (safe on vocab-parallel shards): Gemma 2's soft-capping."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is None:
        return None
    return lambda logits: torch.tanh(logits / cap) * cap


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """Boolean causal mask ``[1, 1, s, s]``, True = masked (Megatron's default mask is allocated on CUDA)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


__all__ = [
    "FAMILIES", "model_family", "transformer_config", "build_gpt_model", "logits_transform", "causal_mask",
    "uses_transformer_engine", "GemmaRMSNorm", "gelu_tanh",
]
