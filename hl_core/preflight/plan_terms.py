"""The per-token memory terms of ``--plan`` (``hl_core.preflight.plan``): what a decoder layer's forward keeps for
backward, and what the token log-probs hold. Counted tensor by tensor for the Hugging Face Llama / Qwen2 /
Gemma 2 layers and our log-prob function, and checked against measurement (``bench/realistic_shapes.py`` on
the CPU at the recipes' exact widths, ``bench/gpu_check.py`` on an H100).

Per token and layer, ``pb`` bytes per element of the compute dtype, ``h`` hidden, ``q = heads * head_dim``,
``kv = kv_heads * head_dim``, ``I`` intermediate, ``t`` tensor-parallel size:

* each RMSNorm keeps a float32 copy of its input (4h; in fp32 the input itself) and its output (pb*h);
  Gemma 2's norm also keeps its float32 normalised value for the ``(1 + weight)`` product (4h more);
* attention keeps q and k as projected (rotary multiplies them), their rotate-half copies, the rotated q,
  k and v repeated to every query head (what SDPA saves under grouped-query attention), SDPA's output and
  the contiguous copy that enters the output projection: ``pb * (7q + 2kv)``;
* the gated MLP keeps gate, up, act(gate) and their product: ``pb * 4I``;
* eager attention (Gemma 2's soft-capped scores) also keeps, per head and key, the float32 softmax and its
  compute-dtype copy, and with soft-capping the tanh output: ``(4 + pb [+ pb]) * heads * s``.

Once per token, not per layer: the final RMSNorm keeps ``(4 + pb) * h`` like the others.

Log-probs (``hl_core.logprobs``): the policy's logits stay for backward (pb per logit; Gemma 2's final
soft-capping keeps its tanh output too, another pb per logit); the backward writes
a logits-sized gradient (pb per logit) and works on one float32 block of ``logps_chunk_tokens`` tokens plus
the compute-dtype copy the gradient is written through (half a block in bf16, none in fp32; the forward's
log-sum-exp needs two blocks, before the gradient exists). The
megatron engine's Gemma 2 path uses megatron-core's vocab-parallel cross entropy, which also keeps a
float32 softmax of every logit (4 per logit).
"""

from __future__ import annotations


def norm_bytes(spec, pb: int) -> float:
    """Per token: one RMSNorm's float32 input (its copy in bf16, itself in fp32) and output (+ Gemma 2's
    float32 normalised value)."""
    return (4 + pb + (4 if spec.model_type.startswith("gemma2") else 0)) * spec.hidden_size


def layer_activation_bytes(spec, pb: int, tp: int = 1, seq_len: int = 0, eager: bool = False) -> float:
    """Bytes one decoder layer's forward keeps for backward, per token (see the module docstring)."""
    q, kv, inter = spec.q_dim, spec.kv_dim, spec.intermediate_size
    norms = spec.norms_per_layer * norm_bytes(spec, pb)
    attention = pb * (7 * q + 2 * kv) / tp
    mlp = pb * 4 * inter / tp
    scores = 0.0
    if eager:
        softcap = spec.model_type.startswith("gemma2")
        scores = (4 + pb + (pb if softcap else 0)) * spec.num_heads * seq_len / tp
    return norms + attention + mlp + scores


def logits_bytes(rows: int, seq_len: int, vocab: int, pb: int, tp: int = 1, chunk_tokens: int = 256,
                 keeps_softmax: bool = False, softcap_copy: bool = False) -> float:
    """Peak bytes of the policy's logits and log-probs over forward and backward (see the docstring)."""
    logits = rows * seq_len * vocab / tp
    block = 4 * min(chunk_tokens, rows * seq_len) * vocab / tp
    written_through = 0.5 if pb < 4 else 0.0  # the compute-dtype copy of a block (none in fp32)
    kept = pb * (2 if softcap_copy else 1) + (4 if keeps_softmax else 0)
    return kept * logits + max(2 * block, pb * logits + (1 + written_through) * block)
