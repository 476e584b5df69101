"""Megatron-core's local core attention through PyTorch's fused ``scaled_dot_product_attention``.

Without Transformer Engine, megatron-core's local layer spec computes attention with
``DotProductAttention``: it materialises the ``[b, heads, s, s]`` scores, runs the softmax in float32
and keeps the float32 probabilities and their 16-bit copy for backward (about 6 bytes per score, 24 GiB
per micro-batch of 8 x 1024 tokens on a Llama-3.2-1B shape: measured on an H100 by
``bench/gpu_check.py``). ``SDPAttention`` is the same module (same constructor, parameters and
per-partition sizes) whose forward hands the causal attention to
``torch.nn.functional.scaled_dot_product_attention``: a flash / memory-efficient kernel on a GPU that
never stores the scores, the plain math on a CPU. Cases it does not cover (a non-causal mask type,
packed sequences, an attention bias, query-key layer scaling, sliding windows, softmax offsets) run the
parent's forward unchanged.

The mask argument is ignored on the fused path: the engine passes megatron's causal mask, and
``is_causal=True`` is that mask. Dropout draws under the tensor-parallel RNG tracker, as the parent does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

_TORCH_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # SDPA's enable_gqa


class SDPAttention(DotProductAttention):
    def _fused(self, attention_bias, packed_seq_params) -> bool:
        config = self.config
        return (
            self.attn_mask_type == AttnMaskType.causal and attention_bias is None and packed_seq_params is None
            and not config.apply_query_key_layer_scaling and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
        )

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._fused(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        seq, batch = query.shape[0], query.shape[1]
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        extra = {}
        if groups > 1:
            if _TORCH_GQA:
                extra["enable_gqa"] = True
            else:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        dropout = self.attention_dropout.p if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=dropout, scale=self.softmax_scale, **extra
            )
        # [b, heads, s, d] -> [s, b, heads * d]
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)


def use_sdpa_attention(block_spec) -> None:
    """Swap ``DotProductAttention`` for ``SDPAttention`` in every layer of a local-spec decoder block."""
    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        if attention.core_attention is DotProductAttention:
            attention.core_attention = SDPAttention


__all__ = ["SDPAttention", "use_sdpa_attention"]
