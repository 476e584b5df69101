"""`--plan`'s model states on one rank: weights, gradients, optimizer states and the reference model, per engine
(the table in ``hl_core/preflight/plan.py``'s docstring), and the LoRA adapter's share of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ..config import Recipe, reference_mode
from ..config.checks import check_lora
from ..models.specs import ModelSpec
from .plan_lora import lora_terms
from .plan_peak import zero2_gradient_elements, zero3_largest_sub_group
from .plan_terms import megatron_cpu_step_bytes, megatron_gpu_step_bytes

# DeepSpeed's ZeRO defaults that the engine leaves as they are (hl_core/engines/deepspeed_engine.py)
REDUCE_BUCKET = 5e8  # reduce_bucket_size (elements), ZeRO 1-3
ZERO3_MAX_LIVE_PARAMETERS = 1e9  # stage3_max_live_parameters (elements; stage3_max_reuse_distance is no larger)
ZERO3_SUB_GROUP_SIZE = 1e9  # sub_group_size (elements): ZeRO-3 steps its optimizer one sub-group at a time


@dataclass
class LoraPart:
    """``model.lora``: the adapter's terms (``plan_lora.lora_terms``), its parameter count, and whether the
    reference is a synced frozen copy of the adapter (else the base with the adapter off, or no model)."""

    terms: dict
    adapter_params: int
    synced: bool


@dataclass
class ModelStates:
    """Bytes of one rank's model states; ``resident_grads`` stay allocated between updates, ``backward_grads``
    live within the backward, ``step_grads`` at the optimizer step (``master_grads``: a bf16 optimizer's float32
    gradients). ``params_on_rank``: parameters held on the rank."""

    weights: float
    grads: float
    optimizer: float
    reference: float
    resident_grads: float
    backward_grads: float
    step_grads: float
    master_grads: float
    params_on_rank: float


def lora_part(recipe: Recipe, spec: ModelSpec, pb: int, notes: List[str]) -> Optional[LoraPart]:
    """The adapter of ``model.lora`` (None without one), with its note."""
    if not recipe.model.lora_enabled:
        return None
    check_lora(recipe)
    terms = lora_terms(spec, recipe.model.lora, pb)  # plan_lora.py: from the dimensions and PEFT's matching
    adapter = terms["adapter_params"]
    copy = reference_mode(recipe)[0] == "copy"
    synced = copy and recipe.humanline.sync_every is not None
    notes.append(
        f"LoRA r={recipe.model.lora.r} on {terms['adapted_modules']} modules: {count_text(adapter)} adapter params "
        f"({100 * adapter / spec.num_params():.2f}% of the model) get gradients and AdamW states; the reference is "
        + ("the base plus a frozen adapter copy (the adapter's bytes)" if synced else
           "the base with the adapter off (0 bytes)" if copy else "no model (see below)")
    )
    return LoraPart(terms, adapter, synced)


def count_text(n: float) -> str:
    """``n`` with a B/M/K suffix."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def megatron_stage_params(spec: ModelSpec, tp: int, pp: int, stage: int) -> int:
    """Parameters on one tensor-parallel rank of pipeline stage ``stage``: matrices split by tp, norms replicated."""
    h = spec.hidden_size
    norms = spec.norms_per_layer * h
    per_stage_layers = spec.num_layers // pp
    matrices = per_stage_layers * (spec.layer_params() - norms)
    replicated = per_stage_layers * norms
    if stage == 0:
        matrices += spec.embedding_params()
    if stage == pp - 1:
        replicated += h  # final norm
        if not spec.tie_word_embeddings or pp > 1:  # tied weights and pp > 1: the last stage keeps its own copy
            matrices += spec.vocab_size * h
    return -(-matrices // tp) + replicated


def megatron_states(recipe: Recipe, spec: ModelSpec, pb: int, dp: int, pipe_stage: int, distributed_optimizer: bool,
                    megatron_gpu: bool, notes: List[str]) -> ModelStates:
    """The megatron engine's model states on the ranks of pipeline stage ``pipe_stage``."""
    tp, pp, bf16 = recipe.parallel.tp, recipe.parallel.pp, pb == 2
    shard = megatron_stage_params(spec, tp, pp, pipe_stage)
    grads = 4 * shard  # fp32 main-grad buffer (whole on each rank, also with the distributed optimizer)
    # GPU: float32 master copy + AdamW moments; the CPU path: torch AdamW on the compute-dtype shards, its two
    # moments in that dtype and no master copy (measured by --rehearse: 1.08 GiB for 0.54 GiB of bf16 weights)
    opt_bytes = (12 if bf16 else 8) * shard if megatron_gpu else 2 * pb * shard
    optimizer = opt_bytes / dp if distributed_optimizer else opt_bytes
    # GPU: megatron's DDP allocates the main-grad buffer up front; CPU path: ``.grad`` in backward
    resident_grads, backward_grads = (grads, 0.0) if megatron_gpu else (0.0, pb * shard)
    # GPU: a fused Adam steps in place, torch's AdamW (megatron's fallback) makes a float32 temporary of its shard;
    # CPU path: its step's temporaries
    step_grads = (megatron_gpu_step_bytes(shard / dp if distributed_optimizer else shard) if megatron_gpu
                  else megatron_cpu_step_bytes(spec, pb, tp, pp, pipe_stage, dp, shard))
    if megatron_gpu and step_grads:
        notes.append("megatron: no fused Adam here (transformer-engine, apex), so megatron-core steps with torch's "
                     "AdamW, which makes a float32 temporary of the optimizer shard (`step gradients`)")
    notes.append(
        "megatron: optimizer states " + ("partitioned over dp (distributed optimizer)" if distributed_optimizer
                                         else "replicated (no distributed optimizer)")
    )
    # no float32 copy of the gradients at the step: the main grads are resident
    return ModelStates(weights=pb * shard, grads=grads, optimizer=optimizer, reference=pb * shard,
                       resident_grads=resident_grads, backward_grads=backward_grads, step_grads=step_grads,
                       master_grads=0.0, params_on_rank=shard)


def deepspeed_states(recipe: Recipe, spec: ModelSpec, pb: int, dp: int, dp_rank: Optional[int],
                     lora: Optional[LoraPart]) -> ModelStates:
    """DeepSpeed's model states at ``engine.zero_stage`` (``dp_rank``: whose ZeRO-2 gradient buffer; None: the
    largest)."""
    stage, bf16 = recipe.engine.zero_stage, pb == 2
    P, L = spec.num_params(), spec.largest_layer_params()
    A = lora.adapter_params if lora else 0
    T = A if lora else P  # trainable parameters
    if stage == 3:
        weights = pb * P / dp + pb * L
        # DeepSpeed's stage-3 estimator convention (18P/N + 4L): the fp32 gradient partition plus the
        # gathered layer's 16-bit gradient; the 16-bit partition it is made from is not counted again
        low = (0 if bf16 else pb * P / dp) + pb * L
        resident_grads = pb * P / dp  # the 16-bit gradient partition, allocated at start-up
        if bf16:
            low += resident_grads
        backward_grads = 0.0 if bf16 else pb * P / dp
        params_on_rank = P / dp
    else:  # LoRA: the frozen base whole, gradients and optimizer states for the T = A adapter params only
        weights = pb * (P + A)
        low = pb * T / dp if stage == 2 else pb * T
        resident_grads, backward_grads = 0.0, low  # compute-dtype gradients (ZeRO-2: this rank's partition)
        if stage == 2 and not lora and dp > 1:  # the buffer DeepSpeed holds for the partition: every parameter
            backward_grads = pb * zero2_gradient_elements(spec, dp, dp_rank)  # overlapping it (plan_peak.py)
        params_on_rank = P + A
    if bf16:
        master_grads = 4 * T if stage == 0 else 4 * T / dp
        grads = low + master_grads
        optimizer = 12 * T if stage == 0 else 12 * T / dp
    else:
        master_grads = 0.0
        grads = low
        optimizer = 8 * T if stage == 0 else 8 * T / dp
    step_grads = master_grads  # the float32 gradients the bf16 optimizer builds at the step
    if stage == 3 and not lora:
        # per sub-group: a flat 16-bit copy of its gradients, then (bf16) its float32 copy, both live at once
        # (``_prepare_fp32_grad_for_sub_group``; an H100 rehearsal of Llama-3-8B's rank 0 of 8 measured 5.61 GiB
        # for 6 bytes x 1.0e9 elements, Gemma-2-27B's rank 0 of 16 5.63 GiB for its first sub-group of 1.0e9)
        sub_group = zero3_largest_sub_group(spec, dp, ZERO3_SUB_GROUP_SIZE)
        step_grads = (pb + 4 if bf16 else pb) * sub_group
    reference = pb * P / dp if stage == 3 else pb * P
    if lora:  # no second model: a frozen copy of the adapter (synced) or nothing (the adapter switched off)
        reference = pb * A if lora.synced else 0.0
    return ModelStates(weights=weights, grads=grads, optimizer=optimizer, reference=reference,
                       resident_grads=resident_grads, backward_grads=backward_grads, step_grads=step_grads,
                       master_grads=master_grads, params_on_rank=params_on_rank)
