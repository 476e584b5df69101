"""`--plan`: the world layout and a per-GPU memory estimate for a recipe, without a GPU or a download.

``memory_plan(recipe, world_size)`` returns a dict; ``plan_report(recipe)`` renders it (world size from
``cluster.nodes * cluster.gpus_per_node`` unless given) and adds a WARNING line when the estimate exceeds
``cluster.gpu_memory_gb`` (read as GiB: an "80 GB" H100 has 80 GiB).

Model states (bytes per parameter, P = parameters, N = data-parallel size, L = largest layer's parameters):

========================  ==================  ======================  =====================================
engine / stage            weights             gradients               optimizer (AdamW)
========================  ==================  ======================  =====================================
bf16 ZeRO-0               2P                  2P (bf16) + 4P (fp32)   12P (fp32 master + 2 moments)
bf16 ZeRO-1               2P                  2P + 4P/N               12P/N
bf16 ZeRO-2               2P                  2P/N + 4P/N             12P/N
bf16 ZeRO-3               2P/N + 2L           4P/N + 2L               12P/N
fp32 ZeRO-s               4P (@3: 4P/N + 4L)  4P (@2: 4P/N; @3: +4L)  8P (two moments; 8P/N at stage >= 1)
megatron (bf16)           2P'                 4P' (fp32 main grads)   12P'/N (distributed optimizer)
========================  ==================  ======================  =====================================

ZeRO-2 sums to DeepSpeed's own estimator exactly (``2P + 18P/N``, ``estimate_zero2_model_states_mem_needs``
without offload); ZeRO-1 keeps whole bf16 gradients, so it is ``2P(1 - 1/N)`` above it. ZeRO-3 is
DeepSpeed's estimate (``18P/N + 4L``: 2 weights + 4 fp32 gradients + 12 optimizer bytes per parameter over
N) plus the 16-bit gradient partition (2P/N) that DeepSpeed's stage-3 optimizer allocates at start-up and
keeps for the whole run (its estimator leaves it out; measured on an H100 by ``bench/gpu_check.py``: 3.2 GiB
more than ZeRO-2 at rest for a 1.24B model on one GPU, of which 2.3 GiB is this buffer).
2L is the largest layer gathered whole in 16 bits (weights) and its 16-bit gradient.
``resident`` is what stays allocated between updates (weights, optimizer states, reference, and the
gradient buffers allocated up front: megatron's fp32 main-grad buffer, ZeRO-3's 16-bit partition); the
other gradients, the activations and the logits come and go within an update.
P' is the largest per-rank shard under tensor/pipeline parallelism: ``(layers/pp) * layer / tp`` plus the
embedding on the first stage and the (untied, or tied copy with pp > 1) output layer on the last.
The reference model has no gradients or optimizer: partitioned like the policy under ZeRO-3 (2P/N),
sharded like the policy under Megatron (2P'), whole (2P) under ZeRO-0/1/2; 0 when the run builds none
(SFT, and standard rollout GRPO without a KL term: ``hl_core.config.reference_needed``; look-ahead syncing
and a cached frozen reference: ``reference_mode``, whose log-probs live in CPU memory, noted).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
16-bit activations, no sequence parallelism), per layer and micro-batch of b sequences of length s:
``s*b*h*(34 + 5*a*s/h)`` bytes, and with tensor parallelism t: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``.
The ``5*a*s/h`` term (attention scores, softmax, dropout mask) is only stored by the `eager` attention;
SDPA / FlashAttention kernels recompute it, so it is dropped for them (the megatron engine always uses a
fused kernel, SDPA or Transformer Engine's, except for Gemma 2's soft-capped attention). Times L layers (L/pp stages x
pp micro-batches in flight under the 1F1B pipeline; "L" here is the layer count). fp32 doubles it. With gradient
checkpointing each layer keeps only its input (``2*s*b*h`` bytes) plus one layer's full activations during recomputation
(DeepSpeed: or the final norm's, whichever is larger, never both: its backward frees them before the first layer is
recomputed;
``plan_peak.py``).
Logits: 8 bytes per logit, ``8*b*s*V/t``: the float32 copy that the log-softmax keeps for backward (4)
plus the compute-dtype logits of the running forward or their gradient in backward (2 + 2); megatron's Gemma 2
path and the megatron CPU path's optimizer step are counted in plan_terms.py (measured by ``--rehearse``).
With a token budget (``train.max_tokens_per_micro_batch``) the activations and logits are those of that many
tokens instead of ``b*s`` (the eager score term still uses s, the longest row).
Sequences per micro-batch b: SFT micro, DPO 2 x micro (chosen + rejected), KTO 2 x micro (completions + KL
pairs), GRPO micro x group size (`rollout.num_generations` with rollouts; else
the first row of a local .jsonl; else 2, as preference pairs become groups of two).
ZeRO-3 over more than one rank, from ``--rehearse`` (hl_core/rehearsal: the tensors DeepSpeed allocated): at rest
the partition only (``weights_at_rest``) plus DeepSpeed's reduce bucket (5e8 16-bit elements, ``reduce_buckets``);
within an update the gathered parameters (``gathered_weights``, in the peak's phase): the prefetcher's window of the
parameters used next, up to ``stage3_max_live_parameters`` (1e9 elements) and the one crossing it
(``plan_peak.zero3_gathered_elements``).
ZeRO-1/2 over more than one rank (also measured by ``--rehearse``): within the backward, the gradient reduction
bucket, 5e8 elements of the gradients' dtype (``backward_bucket``; DeepSpeed's contiguous_gradients without
overlap_comm), allocated at the first gradient that is ready and freed at the end of each backward; ZeRO-2's
16-bit gradient buffer, from the first reduction to the step, holds every parameter that overlaps the rank's
partition whole (``plan_peak.zero2_gradient_elements``: the whole embedding on rank 0, more than P/N; the model
states column keeps DeepSpeed's estimator). DeepSpeed's peak is the largest of the update's phases (log-prob
backward, a layer's backward, the step: ``plan_peak.py``), not the sum of its terms.
Not counted: CUDA context and NCCL buffers, allocator fragmentation, ZeRO-0's none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..config import Recipe, batch_layout, data_plan, pipeline_microbatches, reference_mode
from ..data.build import load_split_records
from ..loop.sources import epoch_steps
from ..models.specs import ModelSpec, check_layout, resolve_spec
from .plan_peak import checkpointed_activations, deepspeed_phases, zero3_gathered_elements
from .plan_states import (
    REDUCE_BUCKET,
    ZERO3_MAX_LIVE_PARAMETERS,
    LoraPart,
    ModelStates,
    count_text,
    deepspeed_states,
    lora_part,
    megatron_states,
)
from .plan_terms import layer_activation_bytes, logits_bytes, megatron_softcap_logits_bytes, norm_bytes

GIB = 1024 ** 3
DEFAULT_GRPO_GROUP_SIZE = 2  # offline GRPO from preference pairs: groups of two


def world_size_of(recipe: Recipe) -> int:
    return recipe.cluster.nodes * recipe.cluster.gpus_per_node


def grpo_group_size(recipe: Recipe) -> Tuple[int, str]:
    """Completions per prompt group and where that number came from."""
    rollout = recipe.rollout
    if rollout.every is not None and getattr(rollout, "num_generations", None):
        return int(rollout.num_generations), "rollout.num_generations"
    path = recipe.data.train_sources[0].path  # a mixture: its first source
    if path and str(path).endswith(".jsonl") and Path(path).is_file():
        try:
            with open(path) as handle:
                row = json.loads(handle.readline() or "{}")
            if isinstance(row.get("completions"), list) and len(row["completions"]) >= 2:
                return len(row["completions"]), f"first row of {path}"
        except (OSError, ValueError, AttributeError):
            pass
    return DEFAULT_GRPO_GROUP_SIZE, "preference pairs become groups of two"


def planned_updates(recipe: Recipe, dp: int, accum: int) -> Tuple[Optional[int], str]:
    """The run's optimizer updates and how they are known: `train.max_steps`, or `train.epochs` over the local
    training rows (counted before tokenizing; pairs that truncation makes identical are dropped at run time, so the
    run may derive fewer); None when the data are named on the Hugging Face hub."""
    train = recipe.train
    if train.epochs is None:
        return train.max_steps, f"updates: {train.max_steps} (`train.max_steps`)"
    if any(source.path is None for source in recipe.data.train_sources):
        return None, (f"updates: derived at run time from `train.epochs: {train.epochs:g}` and the size of the "
                      "Hugging Face data set")
    rows = sum(map(len, load_split_records(recipe.data, data_plan(recipe))[0]))
    steps, line = epoch_steps(train, rows, dp, accum)
    return steps, (f"updates: at most {steps}, from {rows} training rows before tokenizing (the run derives the "
                   f"count from the examples it keeps and logs it): {line}")


def sequences_per_micro_batch(recipe: Recipe, group_size: Optional[int] = None) -> int:
    micro = recipe.train.micro_batch_size
    if recipe.objective.name == "grpo":
        return micro * (group_size or grpo_group_size(recipe)[0])
    if recipe.objective.name == "sft":
        return micro  # one demonstration per example
    return 2 * micro  # dpo: chosen + rejected; kto: completions + mismatched KL completions


def memory_plan(
    recipe: Recipe,
    world_size: Optional[int] = None,
    *,
    spec: Optional[ModelSpec] = None,
    group_size: Optional[int] = None,
    distributed_optimizer: bool = True,
    megatron_gpu: bool = True,
    stage: Optional[int] = None,
    dp_rank: Optional[int] = None,
) -> Dict[str, Any]:
    """Layout and per-GPU memory estimate (bytes and GiB) for ``recipe`` on ``world_size`` processes.
    ``distributed_optimizer`` / ``megatron_gpu`` false: the megatron engine's CPU path (a torch optimizer
    replicated over data parallel, gradients in ``.grad`` instead of a resident fp32 main-grad buffer).
    Megatron with pp > 1: the ranks of pipeline stage ``stage``, or (None) of the stage whose total is largest
    (``stage_totals`` holds each stage's). ``dp_rank``: that data-parallel rank's DeepSpeed ZeRO-2 gradient
    buffer (it depends on the rank, ``plan_peak.zero2_gradient_elements``); None: the largest over the ranks."""
    world = world_size if world_size is not None else world_size_of(recipe)
    check_layout(recipe, world)
    spec = spec or resolve_spec(recipe.model)
    pp = recipe.parallel.pp if recipe.engine.name == "megatron" else 1
    stages = [stage] if stage is not None and pp > 1 else list(range(pp))
    plans = [_stage_plan(recipe, world, spec, group_size, distributed_optimizer, megatron_gpu, s, dp_rank) for s
             in stages]
    worst = max(plans, key=lambda p: p["bytes"]["total"])
    worst["stage_totals"] = {p["stage"]: p["gib"]["total"] for p in plans}
    return worst


def _stage_plan(recipe: Recipe, world: int, spec: ModelSpec, group_size: Optional[int], distributed_optimizer: bool,
                megatron_gpu: bool, pipe_stage: int, dp_rank: Optional[int] = None) -> Dict[str, Any]:
    """`memory_plan` for the ranks of one pipeline stage (stage 0 when there is no pipeline)."""
    dp, accum = batch_layout(recipe, world)
    engine = recipe.engine.name
    pb = 2 if recipe.engine.precision == "bf16" else 4  # bytes per parameter / activation element
    notes: List[str] = []
    lora = lora_part(recipe, spec, pb, notes)
    if engine == "megatron":
        states = megatron_states(recipe, spec, pb, dp, pipe_stage, distributed_optimizer, megatron_gpu, notes)
    else:
        states = deepspeed_states(recipe, spec, pb, dp, dp_rank, lora)
    run_updates = planned_updates(recipe, dp, accum)
    states.reference = _reference_bytes(recipe, states.reference, run_updates, accum, group_size, notes)
    act = _activations(recipe, spec, pb, group_size, pipe_stage, lora)
    bytes_ = _peak(recipe, spec, pb, dp, states, act)
    _layout_notes(recipe, group_size, pipe_stage, act, notes)
    gpu_gib = float(recipe.cluster.gpu_memory_gb)
    P, A = spec.num_params(), lora.adapter_params if lora else 0
    stage, tp, pp = recipe.engine.zero_stage, recipe.parallel.tp, recipe.parallel.pp
    return dict(
        model=spec.name, model_source=spec.source, params=P, largest_layer_params=spec.largest_layer_params(),
        params_per_rank=states.params_on_rank, trainable_params=A if lora else P, lora_adapter_params=A,
        engine=engine, zero_stage=stage if engine == "deepspeed" else None, precision=recipe.engine.precision,
        world_size=world, dp=dp, tp=tp, pp=pp, stage=pipe_stage, micro_batch_size=recipe.train.micro_batch_size,
        gradient_accumulation_steps=accum, global_batch_size=recipe.train.micro_batch_size * accum * dp,
        updates=run_updates,
        sequences_per_micro_batch=act["b"], seq_len=recipe.data.max_length,
        attention="eager" if act["eager"] else "fused (sdpa/flash)",
        tokens_per_micro_batch=act["tokens"], token_budget=act["budget"],
        gradient_checkpointing=bool(recipe.model.gradient_checkpointing), gpu_memory_gib=gpu_gib,
        bytes=bytes_, gib={k: v / GIB for k, v in bytes_.items()},
        exceeds=bytes_["total"] / GIB > gpu_gib, notes=notes,
    )


def _reference_bytes(recipe: Recipe, reference: float, run_updates: Tuple[Optional[int], str], accum: int,
                     group_size: Optional[int], notes: List[str]) -> float:
    """The reference model's bytes: ``reference`` when the run builds one, else 0 (with a note on where its
    log-probs live)."""
    mode, why = reference_mode(recipe)
    if mode == "none":
        notes.append("no reference model: nothing reads its log-probs (SFT, or standard GRPO with beta_kl = 0)")
        return 0.0
    if mode in ("cached", "lookahead"):
        updates = run_updates[0] if mode == "cached" else recipe.humanline.sync_every
        rows = (updates or 1) * accum * sequences_per_micro_batch(recipe, group_size)
        kept = rows * recipe.data.max_length * 4 / 2**20
        notes.append(f"no reference model ({mode}: {why}); its log-probs kept in CPU memory, at most "
                     f"{kept:.2f} MiB per rank " + (f"({updates} update(s) of padded float32 rows)" if updates else
                                                    "per update (padded float32 rows; `train.epochs` over hub data)"))
        return 0.0
    return reference


def _activations(recipe: Recipe, spec: ModelSpec, pb: int, group_size: Optional[int], pipe_stage: int,
                 lora: Optional[LoraPart]) -> Dict[str, Any]:
    """Activations and logits of one micro-batch on the ranks of ``pipe_stage`` (plan_terms: counted tensor by
    tensor, checked against measurement), with the layout facts they follow from."""
    engine, pp = recipe.engine.name, recipe.parallel.pp
    megatron = engine == "megatron"
    b = sequences_per_micro_batch(recipe, group_size)
    s, h, V = recipe.data.max_length, spec.hidden_size, spec.vocab_size
    # megatron: fused attention (SDPA or TE) except Gemma 2's soft-capped local spec
    eager = spec.model_type == "gemma2" if megatron else (recipe.model.attn_implementation or "sdpa") == "eager"
    t = recipe.parallel.tp if megatron else 1
    # tokens per micro-batch: b rows of <= s tokens, or the token budget (`train.max_tokens_per_micro_batch`)
    budget = recipe.train.max_tokens_per_micro_batch
    tokens = budget if budget is not None else s * b
    # megatron pp > 1: each micro-batch runs as m pipeline micro-batches of tokens / m; 1F1B keeps min(pp - stage, m)
    # of them in flight on stage `stage` (the first stage the most); the final norm and the logits on the last stage
    pipeline = pipeline_microbatches(recipe, b) if megatron else 1
    tokens_in_flight = tokens / pipeline
    in_flight = min(pp - pipe_stage, pipeline) if megatron else 1
    last_stage = not megatron or pipe_stage == pp - 1
    per_layer = tokens_in_flight * layer_activation_bytes(spec, pb, t, s, eager)
    layers_on_rank = spec.num_layers // pp if megatron else spec.num_layers
    final_norm = tokens_in_flight * norm_bytes(spec, pb) if last_stage else 0.0  # the final RMSNorm, once per token
    activations_full = per_layer * layers_on_rank * in_flight + final_norm
    layer_inputs = (pb * tokens_in_flight * h) * layers_on_rank * in_flight
    if megatron:  # inputs + one layer + the final norm
        activations_ckpt = layer_inputs + per_layer + final_norm
    else:  # plan_peak.py: the final norm's tensors are freed before the first layer is recomputed
        activations_ckpt = checkpointed_activations(layer_inputs, per_layer, final_norm)
    if lora:  # what the adapters keep (A's outputs, dropout copies): all layers, or one layer being recomputed
        activations_full += tokens * lora.terms["activation_bytes_per_token"]
        activations_ckpt += tokens * lora.terms["activation_bytes_per_token"] / spec.num_layers
    gemma2 = spec.model_type.startswith("gemma2")
    # megatron's Gemma 2 path: soft-capped chunks through megatron-core's cross entropy (plan_terms.py); HF's
    # Gemma 2: the tanh of its final logit soft-capping kept beside the logits
    chunk = recipe.train.logps_chunk_tokens
    logits = (megatron_softcap_logits_bytes(tokens_in_flight, V, pb, t, chunk) if megatron and gemma2 else
              logits_bytes(1, tokens_in_flight, V, pb, t, chunk, softcap_copy=not megatron and gemma2))
    return dict(b=b, eager=eager, tokens=tokens, budget=budget, pipeline=pipeline, in_flight=in_flight,
                last_stage=last_stage, per_layer=per_layer, final_norm=final_norm, layer_inputs=layer_inputs,
                activations_full=activations_full, activations_ckpt=activations_ckpt,
                logits=logits if last_stage else 0.0,
                lora_kept=tokens * lora.terms["activation_bytes_per_token"] if lora else 0.0, lora=lora is not None)


def _peak(recipe: Recipe, spec: ModelSpec, pb: int, dp: int, states: ModelStates, act: Dict[str, Any]
          ) -> Dict[str, float]:
    """Every term's bytes and the peak: resident + the update's largest phase (``total``), and the same with
    gradient checkpointing switched (``total_other_checkpointing``)."""
    engine, stage = recipe.engine.name, recipe.engine.zero_stage
    per_layer, logits = act["per_layer"], act["logits"]
    model_states = states.weights + states.grads + states.optimizer
    # ZeRO-3 over dp > 1 (measured by --rehearse, hl_core/rehearsal): between updates only the partition is held,
    # plus the reduce bucket DeepSpeed allocates at start-up (reduce_bucket_size, 5e8 elements of the 16-bit
    # dtype: the engine leaves DeepSpeed's default); within an update the gathered parameters are not one layer
    # but the prefetcher's window, up to stage3_max_live_parameters, per phase (plan_peak.zero3_gathered_elements)
    zero3 = engine == "deepspeed" and stage == 3 and dp > 1
    weights_at_rest = states.weights - pb * spec.largest_layer_params() if zero3 else states.weights
    buckets = pb * REDUCE_BUCKET if zero3 else 0.0
    # ZeRO-1/2 over dp > 1 (--rehearse, bf16 and fp32): a reduce bucket of the gradients' dtype made in the backward
    zero12 = engine == "deepspeed" and stage in (1, 2) and dp > 1
    backward_bucket = pb * REDUCE_BUCKET if zero12 else 0.0
    checkpointing = bool(recipe.model.gradient_checkpointing)
    persist = recipe.engine.zero3_param_persistence_threshold
    gathered_in = {phase: pb * zero3_gathered_elements(spec, ZERO3_MAX_LIVE_PARAMETERS, persist, phase=phase,
                                                       checkpointing=checkpointing) if zero3 else 0.0
                   for phase in ("logits", "layers")}
    gathered = max(gathered_in.values())  # reported: the peak's phase's (below), else the larger
    resident = weights_at_rest + states.optimizer + states.reference + states.resident_grads + buckets
    full, ckpt = act["activations_full"], act["activations_ckpt"]
    activations = ckpt if checkpointing else full
    other = full if checkpointing else ckpt
    if engine == "megatron":  # checkpointed: the logits peak before any layer is recomputed (only inputs beside them)
        activations, other = (max(a - logits, a - per_layer) if on else a
                              for a, on in ((activations, checkpointing), (other, not checkpointing)))
    # the peak: in the backward (gathered parameters, activations, logits and the gradients of earlier
    # micro-batches held at once) or at the optimizer step (the float32 gradients of a bf16 optimizer)
    base, step_grads = resident + states.backward_grads, states.step_grads
    total = base + max(gathered + backward_bucket + activations + logits, step_grads)
    total_other = base + max(gathered + backward_bucket + other + logits, step_grads)
    phases, tied = {}, 0.0
    if engine == "deepspeed":  # DeepSpeed: the largest of the update's phases (plan_peak.py), not their sum
        tied = pb * spec.vocab_size * spec.hidden_size if spec.tie_word_embeddings and not act["lora"] else 0.0
        phase_terms = dict(gathered_logits=gathered_in["logits"], gathered_layers=gathered_in["layers"],
                           backward_bucket=backward_bucket, layer_inputs=act["layer_inputs"],
                           final_norm=act["final_norm"], logits=logits, tied_output_gradient=tied,
                           step_gradients=step_grads, one_layer=per_layer + act["lora_kept"] / spec.num_layers,
                           activations_full=full)
        phases = deepspeed_phases(checkpointing=checkpointing, **phase_terms)
        other_phases = deepspeed_phases(checkpointing=not checkpointing, **phase_terms)
        total = base + max(phases.values())
        gathered = gathered_in.get(max(phases, key=phases.get), gathered)
        total_other = base + max(other_phases.values())
    return dict(
        weights=states.weights, gradients=states.grads, optimizer=states.optimizer, model_states=model_states,
        reference=states.reference, weights_at_rest=weights_at_rest, reduce_buckets=buckets,
        backward_bucket=backward_bucket, gathered_weights=gathered, resident=resident,
        backward_gradients=states.backward_grads, step_gradients=step_grads, master_gradients=states.master_grads,
        activations_full=full, activations_checkpointed=ckpt, logits=logits,
        total=total, total_other_checkpointing=total_other,
        tied_output_gradient=tied, **{f"phase_{name}": value for name, value in phases.items()},
        **{f"gathered_weights_{name}": value for name, value in gathered_in.items()},
    )


def _layout_notes(recipe: Recipe, group_size: Optional[int], pipe_stage: int, act: Dict[str, Any],
                  notes: List[str]) -> None:
    """Notes on what the plan assumes: the pipeline stage, GRPO's group size, rollouts, the token budget."""
    pp = recipe.parallel.pp
    if recipe.engine.name == "megatron" and pp > 1:
        notes.append(f"pipeline stage {pipe_stage} of {pp}: {act['pipeline']} pipeline micro-batch(es) per "
                     f"micro-batch, {act['in_flight']} in flight here" + ("; the embedding" if pipe_stage == 0 else "")
                     + ("; the output layer and the logits" if act["last_stage"] else ""))
    if recipe.objective.name == "grpo" and group_size is None:
        size, origin = grpo_group_size(recipe)
        notes.append(f"GRPO: {size} completions per prompt group ({origin})")
    if recipe.rollout.every is not None:
        notes.append("rollouts: generation memory (KV cache, sampling) is not counted")
    if act["budget"] is not None:
        notes.append(f"token budget: activations and logits for {act['budget']} tokens per micro-batch "
                     "(`train.max_tokens_per_micro_batch`, real tokens; padding to a micro-batch's longest row adds "
                     "to it unless `data.packing: true`)")


def _phase_lines(v: Dict[str, float]) -> List[str]:
    """DeepSpeed's peak, phase by phase (plan_peak.py)."""
    gathered = "gathered weights + " if v["gathered_weights"] else ""
    return [
        "  peak = at rest + gradients during backward + the largest phase (what is live in it):",
        f"    log-prob backward           {v['phase_logits']:9.2f} ({gathered}kept activations + final norm + logits)",
        f"    a layer's backward          {v['phase_layers']:9.2f} ({gathered}"
        + ("reduce bucket + " if v["backward_bucket"] else "") + "kept activations"
        + (" + tied output layer's gradient)" if v["tied_output_gradient"] else ")"),
        f"    optimizer step              {v['phase_step']:9.2f} (float32 gradients)",
    ]


def plan_report(recipe: Recipe, world_size: Optional[int] = None, group_size: Optional[int] = None) -> str:
    """Human-readable plan: layout, per-GPU GiB by component, and a WARNING line when over budget."""
    plan = memory_plan(recipe, world_size, group_size=group_size)
    g = plan["gib"]
    unit, scale = ("GiB", 1.0) if g["total"] >= 1 else ("MiB", 1024.0)
    v = {k: x * scale for k, x in g.items()}
    engine = (f"DeepSpeed ZeRO-{plan['zero_stage']}" if plan["engine"] == "deepspeed"
              else "Megatron-core (distributed optimizer)")
    ckpt = plan["gradient_checkpointing"]
    lines = [
        f"plan for `{recipe.name}`: {plan['model']} ({count_text(plan['params'])} params; dims from "
        f"{plan['model_source']})",
        f"world: {plan['world_size']} GPUs = {recipe.cluster.nodes} node(s) x {recipe.cluster.gpus_per_node}"
        if world_size is None else f"world: {plan['world_size']} processes",
        f"layout: dp={plan['dp']} tp={plan['tp']} pp={plan['pp']}; {engine}, {plan['precision']}",
        f"batch: micro {plan['micro_batch_size']} x grad-accum {plan['gradient_accumulation_steps']} x dp {plan['dp']}"
        f" = global {plan['global_batch_size']} ("
        + (f"micro-batches of <= {plan['token_budget']} tokens (token budget), rows of <= {plan['seq_len']} tokens"
           if plan["token_budget"] is not None else
           f"{plan['sequences_per_micro_batch']} sequences of <= {plan['seq_len']} tokens per micro-batch")
        + f", {plan['attention']} attention)",
        plan["updates"][1],
        f"per-GPU memory estimate ({unit}):",
        "  at rest (between updates)",
        f"    weights (policy)            {v['weights_at_rest']:9.2f}",
        f"    optimizer states (AdamW)    {v['optimizer']:9.2f}",
        f"    reference model             {v['reference']:9.2f}",
        f"    gradient buffers kept       "
        f"{v['resident'] - v['weights_at_rest'] - v['optimizer'] - v['reference'] - v['reduce_buckets']:9.2f}",
        *([f"    reduce bucket (ZeRO-3)      {v['reduce_buckets']:9.2f}"] if v["reduce_buckets"] else []),
        "  within an update",
    ] + ([f"    gathered weights (ZeRO-3)   {v['gathered_weights']:9.2f}"] if v["gathered_weights"] else []) + (
        [f"    reduce bucket (ZeRO-1/2)    {v['backward_bucket']:9.2f}"] if v["backward_bucket"] else []) + [
        f"    gradients during backward   {v['backward_gradients']:9.2f}",
        f"    float32 gradients at step   {v['step_gradients']:9.2f}",
        f"    activations                 {v['activations_full']:9.2f} without gradient checkpointing"
        + ("" if ckpt else "  <- recipe"),
        f"                                {v['activations_checkpointed']:9.2f} with gradient checkpointing"
        + ("  <- recipe" if ckpt else ""),
        f"    logits and log-probs        {v['logits']:9.2f}",
    ] + (_phase_lines(v) if "phase_logits" in v else [
        "  peak = at rest + gradients during backward + max(" + ("gathered weights + " if v["gathered_weights"] else "")
        + ("reduce bucket + " if v["backward_bucket"] else "")
        + "activations + logits, float32 gradients at step)"]) + [
        f"  total                         {v['total']:9.2f} (model.gradient_checkpointing={str(ckpt).lower()}; "
        f"{v['total_other_checkpointing']:.2f} with it {'off' if ckpt else 'on'})",
        f"  GPU memory                    {plan['gpu_memory_gib'] * scale:9.2f} (cluster.gpu_memory_gb)",
        "checked against measurement (docs/results/performance.md): on an H100 (bench/gpu_check.py: DeepSpeed ZeRO-2/3 "
        "and megatron tp=1, one GPU, a Llama-3.2-1B shape) and on the CPU at the recipes' exact widths "
        "(bench/realistic_shapes.py: ZeRO-0/3 over 2 processes, megatron tp=2 and pp=2; Llama-3-8B and "
        "Gemma-2-27B layers forward and backward); by --rehearse (docs/perf/rehearse_cpu_*.md); not yet: NCCL buffers, "
        "Transformer Engine layers, megatron's Gemma 2 layers, pipeline parallel on GPUs.",
    ]
    lines += [f"note: {n}" for n in plan["notes"]]
    if plan["exceeds"]:
        hints = []
        if not ckpt and g["total_other_checkpointing"] <= plan["gpu_memory_gib"]:
            hints.append("set `model.gradient_checkpointing=true`")
        if plan["engine"] == "deepspeed" and plan["zero_stage"] < 3:
            hints.append("raise `engine.zero_stage`")
        if plan["engine"] == "megatron":
            hints.append("raise `parallel.tp` (splits weights, activations and logits) or `parallel.pp` (splits "
                         "layers)")
        hints += ["lower `train.max_tokens_per_micro_batch`" if plan["token_budget"] is not None
                  else "lower `train.micro_batch_size` or `data.max_length`", "use more GPUs"]
        lines.append(
            f"WARNING: the estimate ({g['total']:.1f} GiB per GPU) exceeds `cluster.gpu_memory_gb` "
            f"({plan['gpu_memory_gib']:g}). Fix: " + ", or ".join(hints) + "."
        )
    return "\n".join(lines)
