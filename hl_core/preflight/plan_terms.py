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
log-sum-exp needs two blocks, before the gradient exists).

The megatron engine's Gemma 2 path (``hl_core.engines.megatron_logps``, a soft-capped ``transform``), L logits of
one pipeline micro-batch (``tokens * V / t``) in chunks of c (``logps_chunk_tokens`` tokens): each chunk is copied
to float32, divided by the cap, tanh'd (autograd keeps the tanh output: 4 per logit) and multiplied back; that
product goes into megatron-core's ``vocab_parallel_cross_entropy``, which turns it into the softmax in place and
keeps it for backward (4 per logit). So the forward ends holding the logits (pb L), 8 bytes per logit of every
chunk, and the last chunk's copy and quotient beside its tanh (4c more): ``(pb + 8) L + 4c``. The backward walks
the chunks from the last; each chunk's slice of the logits hands back a gradient of the logits' full size
(``SliceBackward``: zeros but for the chunk, pb L) that autograd sums into the running one, so from the second
chunk on the logits, the running sum and the new full-size gradient (3 pb L) sit beside the float32 tensors of the
chunks not yet reached: ``3 pb L + 8 (L - 2c)`` (the first chunk: ``2 pb L + 8 (L - c)``). Measured by
``--rehearse`` on the last stage of recipes/gemma2_27b_humanline_dpo.yaml to the byte (1 row of 256, 1024 and 2048
tokens, V/t = 32000, c = 256 and 128 tokens).

The megatron engine's CPU step (``MegatronEngine._cpu_step``, bf16 or fp32 shards in ``.grad``; see
`megatron_cpu_step_bytes`): over dp > 1 the flat copy of every gradient it all-reduces (pb per parameter,
alive to the end of the step); the global gradient norm's ``grad.float().pow(2)`` of one tensor at a time (two
float32 temporaries in bf16, one in fp32; the last stage's tied output-layer copy is ``shared`` and left out);
torch AdamW's per-tensor step (the CPU has no foreach kernels) ``denom = exp_avg_sq.sqrt() / c``: two compute-dtype
temporaries of the tensor being stepped, while the previous tensor's ``denom`` is still bound (3 tensors' worth).
"""

from __future__ import annotations

from ..config.checks import installed


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
                 softcap_copy: bool = False) -> float:
    """Peak bytes of the policy's logits and log-probs over forward and backward (see the docstring)."""
    logits = rows * seq_len * vocab / tp
    block = 4 * min(chunk_tokens, rows * seq_len) * vocab / tp
    written_through = 0.5 if pb < 4 else 0.0  # the compute-dtype copy of a block (none in fp32)
    kept = pb * (2 if softcap_copy else 1)
    return kept * logits + max(2 * block, pb * logits + (1 + written_through) * block)


def megatron_softcap_logits_bytes(tokens: float, vocab: int, pb: int, tp: int, chunk_tokens: int) -> float:
    """Peak bytes of the logits on megatron's soft-capped (Gemma 2) path for one pipeline micro-batch of
    ``tokens``: the larger of the forward's end and the backward's second chunk (see the module docstring)."""
    logits = tokens * vocab / tp
    chunk = min(chunk_tokens, tokens) * vocab / tp
    forward = (pb + 8) * logits + 4 * chunk
    backward = max(2 * pb * logits + 8 * (logits - chunk), 3 * pb * logits + 8 * (logits - 2 * chunk))
    return max(forward, backward if chunk < logits else 0.0)


def megatron_cpu_step_bytes(spec, pb: int, tp: int, pp: int, stage: int, dp: int, shard: float) -> float:
    """Peak bytes the megatron CPU path's optimizer step makes (see the module docstring): the dp all-reduce's
    flat gradient copy, then the larger of the norm's float32 temporaries and AdamW's, over this rank's matrices
    in the order the optimizer steps them (the decay group: embedding, each layer's qkv, proj, fc1, fc2, output
    layer; the vectors, in the no-decay group after them, are small)."""
    h = spec.hidden_size
    q, k, v, o, gate, up, down = spec.layer_matrices()
    layer = [q + k + v, o, gate + up, down]  # megatron's fused linear_qkv, linear_proj, linear_fc1, linear_fc2
    matrices = [spec.vocab_size * h] if stage == 0 else []
    matrices += layer * (spec.num_layers // pp)
    output = stage == pp - 1 and (not spec.tie_word_embeddings or pp > 1)
    matrices += [spec.vocab_size * h] if output else []
    matrices = [m / tp for m in matrices]
    normed = matrices[:-1] if output and spec.tie_word_embeddings else matrices  # the tied copy is `shared`
    norm = (8 if pb < 4 else 4) * max(normed)
    adam = max(pb * (2 * m + previous) for m, previous in zip(matrices, [0.0] + matrices[:-1]))
    return (pb * shard if dp > 1 else 0.0) + max(norm, adam)


def fused_adam_installed() -> bool:
    """Whether megatron-core will step with a fused Adam (transformer-engine's, else apex's), as it picks one."""
    return installed("transformer_engine.pytorch.optimizers") or installed("apex.optimizers")


def megatron_gpu_step_bytes(optimizer_elements: float) -> float:
    """Peak bytes megatron-core's GPU optimizer step makes over ``optimizer_elements`` (this rank's shard of the
    float32 master weights). A fused Adam (transformer-engine or apex) updates in place: none. Without one megatron
    falls back to torch's AdamW, whose multi-tensor step takes a float32 square root of every second moment first:
    4 bytes per element (an H100 rehearsal of Gemma-2-27B at tp 8 x pp 2, stage 0, dp 1 measured 6.614 GiB here
    for 6.615 GiB of float32 shard). Read on the machine that plans: plan on one like the GPU nodes."""
    return 0.0 if fused_adam_installed() else 4.0 * optimizer_elements
