"""The within-update part of ``--plan``'s DeepSpeed peak (``hl_core.preflight.plan``), phase by phase: the terms
of an update do not all coincide, so the peak is the largest of what is live in each phase, each phase counting
the tensors that are really live then (checked tensor by tensor against ``--rehearse``, hl_core/rehearsal, at
small and at the recipes' widths: docs/perf/rehearse_cpu_deepspeed_*.md).

The backward runs the model in reverse; with Hugging Face's gradient checkpointing (torch's non-reentrant
``torch.utils.checkpoint`` around each decoder layer) every layer keeps only its input until its backward
recomputes it:

* ``logits``, the log-prob backward (and the end of the forward): every layer's kept input (all activations
  without checkpointing), the final norm's saved tensors and the logits and log-prob terms. No gradient of a
  parameter exists yet in this micro-batch, so ZeRO-1/2's reduction bucket (allocated by DeepSpeed at the first
  gradient that is ready, freed at the end of each backward) is not here.
* ``layers``, a decoder layer's backward: the final norm's saved tensors were freed by its backward, which runs
  first, and the logits by theirs; with checkpointing, the kept inputs plus one layer's recomputed tensors (all
  of them live when its recomputation ends; its backward then frees them as it goes); without, the layers'
  activations. Beside them: ZeRO-1/2's reduction bucket, and with tied input and output embeddings the output
  layer's whole gradient (``pb * V * h``), which autograd holds in the embedding's input buffer from the output
  layer's backward until the embedding's own backward, the very last, adds the second use to it (the parameter's
  hooks, and so DeepSpeed's reduction, fire only then). Frozen embeddings (LoRA) have none.
* ``step``: the float32 gradients a bf16 optimizer builds (``step_gradients``).

ZeRO-3's gathered parameters are in both backward phases, each phase with its own (``zero3_gathered_elements``);
the gradients held between micro-batches (``backward_gradients``) and everything at rest are added outside the
phases by the caller.

ZeRO-3's gathered parameters, from DeepSpeed 0.19.8's ``PartitionedParameterCoordinator``
(deepspeed/runtime/zero/partitioned_param_coordinator.py). Once an update has run, the coordinator holds the trace
of the module hooks of one forward and backward (``ZeRoTraceMode.COMPLETE``; reset at each forward of the whole
model, so every update after the first). At every module's fetch it prefetches the parameters of the modules that
come next in the trace, in trace order, for as long as the elements it holds whole (``n_available``: gathered or in
flight, persistent parameters, at most ``stage3_param_persistence_threshold`` elements each, not counted) are
below ``stage3_max_live_parameters`` (1e9, DeepSpeed's default, the engine sets none), ``stage3_prefetch_bucket_size``
(5e7) per fetch: the many fetches of each layer (a hook per module) top it up to that bound, and the parameter
that crosses it is gathered whole. A module's parameters are released after its forward or backward unless they are
used again within ``stage3_max_reuse_distance`` (1e9) trace elements, or the prefetcher already passed their next
use (it skips parameters still held and marks them kept). So, between two hooks, what is held whole is the window
of the distinct parameters whose uses come next, in trace order, up to the first whose running sum reaches
``stage3_max_live_parameters``: the reuse distance keeps nothing outside it while it is no larger (both 1e9).
The trace's backward, per decoder layer from the last: under checkpointing, the output projection of the MLP
first (its pre-backward hook fires before torch recomputes the layer), then the layer's recomputed forward
(q, k, v, o, gate, up), whose parameters stay for its backward; without checkpointing the modules in reverse.
The embedding's backward is the last use of all. Hence:

* ``logits`` (the log-prob backward, after the output layer's forward): the output layer (kept for its backward;
  tied: the embedding), then the layers from the last, then the (untied) embedding;
* ``layers`` (a layer's backward, its recomputed tensors live): the layer's parameters but its MLP output
  projection, whose backward runs first and releases it (the rehearsals' peaks fell there, its gradients made),
  then the layers below, then the embedding; counted from the last layer, where the kept inputs are most.

An H100 rehearsal of recipes/llama3_8b_humanline_dpo.yaml (rank 0 of 8, 32 layers) held 1.020e9 elements at its
peak (logits phase: the output layer + layers 31 and 30 + layer 29's down projection, as this says to the element),
recipes/gemma2_27b_humanline_dpo_zero3.yaml's rank 0 of 16 (46 layers) 1.132e9 at its peak (a layer's backward:
two layers' worth, as this says), and at 2 layers on the CPU 2.142e9 (the top layer but its down projection, the
other layer and the tied embedding, as this says). DeepSpeed's coordinator run on the CPU on a 32-layer
Llama-shaped model at 1/4096 of the widths, the three settings scaled alike, held the same window at the logits
phase. The first update (no trace yet) prefetches nothing and holds less.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple


def deepspeed_phases(*, gathered_logits: float, gathered_layers: float, backward_bucket: float, layer_inputs: float,
                     one_layer: float,
                     final_norm: float, activations_full: float, logits: float, tied_output_gradient: float,
                     step_gradients: float, checkpointing: bool) -> Dict[str, float]:
    """Bytes live within an update beyond the resident ones, per phase (see the module docstring).
    ``layer_inputs``: every layer's kept input under checkpointing; ``one_layer``: what one layer's forward keeps
    for backward; ``activations_full``: every layer's plus the final norm's, without checkpointing."""
    layers_kept = layer_inputs + one_layer if checkpointing else activations_full - final_norm
    return dict(
        logits=gathered_logits + (layer_inputs + final_norm if checkpointing else activations_full) + logits,
        layers=gathered_layers + backward_bucket + layers_kept + tied_output_gradient,
        step=step_gradients,
    )


def checkpointed_activations(layer_inputs: float, one_layer: float, final_norm: float) -> float:
    """The activations' own peak under checkpointing: the kept inputs plus the larger of the final norm's saved
    tensors (end of the forward, log-prob backward) and one recomputed layer (a layer's backward); never both,
    as the final norm's backward frees its tensors before the first layer is recomputed."""
    return layer_inputs + max(final_norm, one_layer)


def _matrices_and_vectors(spec) -> Tuple[List[int], List[int]]:
    """Element counts of the model's parameter tensors in its order, split as the DeepSpeed engine groups them
    (hl_core/engines/deepspeed_engine.py: matrices with weight decay, vectors without)."""
    lm_head = [spec.lm_head_params()] if spec.lm_head_params() else []
    matrices = [spec.embedding_params()] + spec.layer_matrices() * spec.num_layers + lm_head
    vectors = spec.layer_vectors() * spec.num_layers + [spec.hidden_size]  # + the final norm
    return matrices, vectors


def zero3_largest_sub_group(spec, dp: int, sub_group_size: float) -> int:
    """Elements of the largest optimizer sub-group on a ZeRO-3 rank. DeepSpeed steps each parameter group in
    sub-groups (``_create_fp16_sub_groups`` in deepspeed/runtime/zero/stage3.py): a group no larger than
    ``sub_group_size`` is one; a larger one is cut after each parameter that brings the running count (this rank's
    partition of each, ``ceil(numel / dp)``, in the model's order) to ``sub_group_size``."""
    largest = 0
    for group in _matrices_and_vectors(spec):
        sizes = [-(-n // dp) for n in group]
        if sum(sizes) <= sub_group_size:
            largest = max(largest, sum(sizes))
            continue
        running = 0
        for size in sizes:
            running += size
            if running >= sub_group_size:
                largest, running = max(largest, running), 0
        largest = max(largest, running)
    return largest


def zero3_gathered_elements(spec, max_live: float, persistence_threshold: int, *, phase: str,
                            checkpointing: bool) -> int:
    """Elements ZeRO-3 holds whole in phase ``logits`` or ``layers`` once its trace is complete (see the module
    docstring): the distinct parameters in the order of their next use, up to and including the one that brings
    the running sum to ``max_live`` (``stage3_max_live_parameters``), at most every partitioned one. Parameters of
    at most ``persistence_threshold`` elements (norms, the recipes' biases) are persistent and not counted."""
    q, k, v, o, gate, up, down = spec.layer_matrices()
    layer = [down, q, k, v, o, gate, up] if checkpointing else [down, up, gate, o, v, k, q]
    layer = [n for n in layer if n > persistence_threshold]
    layer.append(sum(n for n in spec.layer_vectors() if n > persistence_threshold))  # none for the recipes' models
    embedding = spec.embedding_params()
    output = [spec.lm_head_params() or embedding] if phase == "logits" else []  # tied: the embedding's one tensor
    last = [embedding] if spec.lm_head_params() or phase == "layers" else []
    # a layer's backward: the top layer's peak comes once its first backward (the MLP's output projection) is done
    # and has released that projection, which the window then passes over
    order = output + (layer if phase == "logits" else layer[1:]) + layer * (spec.num_layers - 1) + last
    held = 0
    for numel in order:
        held += numel
        if held >= max_live:
            break
    return held


def _overlapping(sizes: List[int], dp: int, rank: int) -> int:
    """Elements of the tensors (each whole) that overlap rank ``rank``'s 1/dp of their concatenation."""
    part = -(-sum(sizes) // dp)
    lo, hi = rank * part, (rank + 1) * part
    total, start = 0, 0
    for size in sizes:
        if start < hi and start + size > lo:
            total += size
        start += size
    return total


def zero2_gradient_elements(spec, dp: int, rank: Optional[int] = None) -> int:
    """Elements of the 16-bit gradient buffer DeepSpeed's ZeRO-2 keeps on a data-parallel rank from its first
    reduction to the step (``grads_in_partition`` in deepspeed/runtime/zero/stage_1_and_2.py): sized by every
    parameter that overlaps the rank's 1/dp of each parameter group's flattened tensors, each whole, not by the
    partition. The flattening follows the model's order, embedding first, so rank 0's buffer holds the whole
    embedding (``V * h``: more than P/dp for the recipes' models) and the next rank the embedding too if its range
    starts inside it. ``rank`` None: the largest over the ranks."""
    matrices, vectors = _matrices_and_vectors(spec)
    ranks = range(dp) if rank is None else [rank]
    return max(_overlapping(matrices, dp, r) + _overlapping(vectors, dp, r) for r in ranks)
