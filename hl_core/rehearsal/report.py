"""A rehearsal's findings beside ``--plan`` for the same rank: memory term by term, compute, traffic, and the
projected update time (a model, stated as one)."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .world import INFINIBAND_BYTES_PER_S, NVLINK_BYTES_PER_S

GIB = 1024 ** 3
TOLERANCE = 0.10  # a measured term further than this from the plan's is flagged
NEGLIGIBLE = 64 * 1024 ** 2  # terms this small on both sides are not compared


def memory_rows(result: Dict) -> List[Tuple[str, int, float, str]]:
    """``(label, measured bytes, plan bytes, how measured)`` per memory term."""
    m, plan = result["memory"], result["plan"]["bytes"]
    weights = plan.get("weights_at_rest", plan["weights"])
    kept = plan["resident"] - weights - plan["optimizer"] - plan["reference"]
    # the CPU step makes two float32 temporaries the size of the largest tensor it steps, which the fused GPU
    # kernels do not: torch AdamW's per-tensor temporaries (DeepSpeed's flat float32 partition; bench/
    # realistic_shapes.py measured the same). The megatron CPU path's plan counts its own step (plan_terms.py)
    cpu = result["device"] == "CPU" and result["engine"] != "megatron"
    cpu_step = 2 * 4 * m.get("largest_stepped_numel", 0) if cpu else 0
    step_note = " (plan + 2 float32 temporaries of the largest stepped tensor: the CPU step)" if cpu_step else ""
    # the torch step on the CPU comes after ZeRO-3's flat copies are freed: the larger of the two phases
    step_plan = max(plan["step_gradients"], plan.get("master_gradients", plan["step_gradients"]) + cpu_step) \
        if cpu_step else plan["step_gradients"]
    peak_plan = max(plan["total"], plan["resident"] + plan["backward_gradients"] + step_plan)
    checkpointing = result["plan"]["gradient_checkpointing"]
    activations = plan["activations_checkpointed"] if checkpointing else plan["activations_full"]
    process = "allocator max_memory_allocated" if result["device"] != "CPU" else "process VmHWM above the start"
    return [
        ("at rest", m["at_rest"], plan["resident"], "live tensor storages after an update"),
        ("  weights (policy)", m["weights"], weights, "policy parameters (ZeRO-3: this rank's partition)"),
        ("  optimizer states", m["optimizer"], plan["optimizer"], "optimizer states + float32 master copies"),
        ("  reference model", m["reference"], plan["reference"], "reference parameters"),
        ("  gradient buffers, other", m["kept_other"], kept, "every other live storage"),
        ("gradients during backward", m["backward_gradients"], plan["backward_gradients"],
         "storages made in backward, live after the last one"),
        ("float32 gradients at step", m["step_gradients"], step_plan,
         "peak of storages made in the step" + step_note),
        ("gathered weights (ZeRO-3)", m["at_peak"].get("gathered", 0), plan.get("gathered_weights", 0.0),
         "whole parameters DeepSpeed held gathered at the peak"),
        ("activations", m["activations"], activations, "peak of saved tensors + recomputation"),
        ("logits and log-probs", m["logits"], plan["logits"], "peak of vocabulary-wide tensors"),
        ("peak (tensors)", m["peak_tensors"], peak_plan, "at rest + peak of every storage made in the update"),
        ("peak (process)", m["peak_process"], peak_plan, process),
    ]


def disagreements(result: Dict) -> List[str]:
    """Memory terms further than ``TOLERANCE`` from the plan (both sides over ``NEGLIGIBLE``)."""
    out = []
    for label, measured, planned, _ in memory_rows(result):
        if max(measured, planned) < NEGLIGIBLE:
            continue
        if planned == 0 or abs(measured / planned - 1) > TOLERANCE:
            out.append(label.strip())
    return out


def _ratio(measured: float, planned: float) -> str:
    if max(measured, planned) < NEGLIGIBLE:
        return "-"
    return f"{measured / planned:.2f}" if planned else "inf"


def projected_seconds(result: Dict) -> Optional[Dict[str, float]]:
    comm = sum(row["seconds"] for row in result["traffic"].values())
    timed = result.get("timed")
    compute = timed["update_s"] if timed else None
    return dict(communication_s=comm, compute_s=compute, update_s=None if compute is None else compute + comm)


def render(result: Dict) -> str:
    c = result["coords"]
    layout = (f"dp rank {c['dp']} of {c['dp_size']}, tp rank {c['tp']} of {result['plan']['tp']}, "
              f"pipeline stage {c['pp_stage']} of {result['plan']['pp']}")
    engine = (f"DeepSpeed ZeRO-{result['zero_stage']}" if result["engine"] == "deepspeed" else "Megatron-core")
    kernels = ("real kernels" if result["kernels"] == "real" else
               f"shape-only kernels ({result['kernels_skipped']} products and attention calls returned zeros of "
               "their real shapes: memory is real, values and compute time are not)")
    lines = [
        f"rehearsal of `{result['recipe']}`: rank {result['rank']} of {result['world_size']} ({layout}); every other "
        "rank is torch's fake process group",
        f"  {result['model']} at {result['layers']} layers, {engine}, {result['precision']}, on {result['device']}, "
        f"{kernels}",
        f"  reference log-probs: {result['reference_mode']}; {result['micro_batches']} micro-batches per update "
        f"rehearsed (the recipe's: {result['accumulation']})",
    ]
    lines += [f"  {note}" for note in result["notes"]]
    rows = memory_rows(result)
    unit, scale = ("GiB", GIB) if max(r[2] for r in rows) >= GIB else ("MiB", 1024 ** 2)
    lines.append(f"memory of this rank ({unit}), beside --plan for pipeline stage {c['pp_stage']} "
                 f"({result['plan_flavour']}):")
    lines.append(f"  {'term':<28}{'measured':>10}{'plan':>10}{'ratio':>8}  how measured")
    for label, measured, planned, how in rows:
        lines.append(f"  {label:<28}{measured / scale:10.2f}{planned / scale:10.2f}{_ratio(measured, planned):>8}  "
                     f"{how}")
    off = disagreements(result)
    if off:
        lines.append(f"  WARNING: more than {TOLERANCE:.0%} from the plan: {', '.join(off)}")
    lines.append("traffic of this rank per update (counted at the process group; payload = the tensors handed to "
                 "the collective):")
    for kind, row in sorted(result["traffic"].items()):
        link = "InfiniBand" if row["between_nodes"] else "NVLink"
        lines.append(f"  {kind:<16}{row['calls']:8.0f} calls {row['payload'] / GIB:9.3f} GiB payload  "
                     f"{row['wire'] / GIB:9.3f} GiB on the link ({link}) {row['seconds']:8.3f} s")
    sync = result["sync_bytes"]
    lines.append(f"  humanline sync: {sync / GIB:.3f} GiB moved" + (
        " (shard-local copy: no collective)" if sync == 0 and result["reference_mode"] == "copy" else
        " (look-ahead: the policy's forwards over the coming batches)" if result["reference_mode"] == "lookahead"
        else ""))
    times = projected_seconds(result)
    bandwidth = (f"NVLink {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s within a node, InfiniBand "
                 f"{INFINIBAND_BYTES_PER_S / 1e9:.0f} GB/s between nodes, ring algorithms, no overlap")
    if times["compute_s"] is None:
        lines.append(f"time per update: compute not measured (shape-only kernels); communication "
                     f"{times['communication_s']:.2f} s at {bandwidth} (a model)")
    else:
        lines.append(f"time per update: compute {times['compute_s']:.2f} s on {result['device']} (a lower bound: no "
                     f"communication) + communication {times['communication_s']:.2f} s at {bandwidth} = "
                     f"{times['update_s']:.2f} s projected (a model)")
    if result.get("zeroed_gradients"):
        events = result["zeroed_gradients"]
        lines.append(f"  note: {len(events)} gradient tensor(s) held NaN or inf (garbage of the fake world) and were "
                     "zeroed so that the optimizer step ran: " + ", ".join(
                         f"update {e['update']} {e['dtype']}{tuple(e['shape'])}" for e in events[:6])
                     + (" ..." if len(events) > 6 else ""))
    if result["skipped_updates"]:
        lines.append(f"  note: {result['skipped_updates']} update(s) had non-finite values (fake collectives) and "
                     "skipped their optimizer step")
    lines.append("nothing written: this rehearsal's output_dir was a temporary directory, removed (no checkpoint, "
                 "final/ or metrics)")
    return "\n".join(lines)
