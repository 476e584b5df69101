"""The runs of ``bench/gpu_check.py``: what each section trains, how one run is measured (in its own
process), the derived figures, the cross-engine comparisons and the Markdown table."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Dict, List

from bench.gpu_check_trl import trl_dpo
from bench.memprobe import CudaProbe, phase_memory
from bench.packing import long_tailed_pairs
from bench.shapes import REPO, forward_flops_per_token, spec_of, write_model_dir, write_prompts, write_rows

RESULT_PREFIX = "GPU_CHECK_RESULT "
GIB = 1024 ** 3

# full size: a Llama-3.2-1B-shaped model at full depth; dry run: the same family at toy size on the CPU
SIZES = {
    False: dict(seq=1024, prompt_tokens=24, pair_micro=4, global_pairs=8, warmup=2, steps=5, rows=64,
                gen_prompts=16, gen_samples=8, gen_tokens=256, gen_updates=2, cmp_layers=2, cmp_steps=8,
                mix_seq=2048, mix_rows=64),
    True: dict(seq=64, prompt_tokens=8, pair_micro=2, global_pairs=4, warmup=0, steps=1, rows=16,
               gen_prompts=2, gen_samples=2, gen_tokens=4, gen_updates=1, cmp_layers=2, cmp_steps=3,
               mix_seq=128, mix_rows=8),
}
DRY_DIMS = dict(hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=512)
MEGATRON = [("megatron.core", "megatron-core")]
FLASH = [("flash_attn", "flash-attn")]
LIGER = [("liger_kernel", "liger-kernel")]
TRL = [("trl", "trl")]
# runs a --dry-run leaves out, and why (the rest of each section runs on the CPU at toy size)
NO_DRY_RUN = {"liger": "Liger-Kernel's Triton kernels run on a GPU only",
              "compile": "inductor compiles for minutes on a CPU; `train.compile` against eager layers is tested on "
                         "the CPU by tests/test_speed_modes.py"}
FUSED, COMPILED, KERNELS = "train.fused_logprobs=true", "train.compile=true", "model.kernels=liger"
# Per-update loss agreement on the same weights and batches: (run, against, precision, updates compared).
# fp32 (TF32 off): the engines compute the same function and differ only in summation order: 1e-4.
# bf16: DeepSpeed differs from itself by more than one expects (ZeRO-3 vs ZeRO-2, and the same ZeRO-2 run
# on two days, drifted apart by up to 0.08 in 5 updates at lr 1e-5 on an H100: nondeterministic kernels
# and bf16 rounding, amplified because each update is a clipped unit-norm step). So the ZeRO-3 line is
# reported as that noise floor (no tolerance of its own) and megatron is held to
# max(5e-2, 2 x the floor measured in the same check).
TOLERANCE = {"bf16": 5e-2, "fp32": 1e-4}
NOISE_FLOOR = ("ds_z3_hl_dpo", "ds_z2_hl_dpo", "bf16", 5)
COMPARED = (NOISE_FLOOR, ("mg_hl_dpo_bf16", "ds_z2_hl_dpo", "bf16", 5),
            ("mg_hl_dpo_fp32", "ds_z0_hl_dpo_fp32", "fp32", None))
EXTRA_UPDATES = 3  # after the measured ones: one with per-call memory instrumentation, two under the profiler


PROFILED = ("ds_z2_hl_dpo", "mg_hl_dpo_bf16")  # with --profile DIR: their operator tables go to DIR/<id>.txt


def plan_runs(workdir: Path, dry_run: bool, sections, profile_dir=None) -> List[dict]:
    """Write the model directories and data the runs need under ``workdir``; return the runs in order."""
    size = SIZES[dry_run]
    dims = DRY_DIMS if dry_run else {}
    # the dry run: two layers (each run's forwards and backward are a fraction of its start-up either way)
    full = write_model_dir(spec_of("llama3.2-1b", **dims, **({"num_layers": 2} if dry_run else {})), workdir / "model")
    shallow = write_model_dir(spec_of("llama3.2-1b", num_layers=size["cmp_layers"], **dims), workdir / "model_shallow")
    completion = size["seq"] - size["prompt_tokens"] - 16  # room for the chat template's tokens
    pairs, sft, prompts = workdir / "pairs.jsonl", workdir / "sft.jsonl", workdir / "prompts.jsonl"
    write_rows(pairs, "pairs", size["rows"], completion, size["prompt_tokens"])
    write_rows(sft, "sft", size["rows"], completion, size["prompt_tokens"], seed=1)
    write_prompts(prompts, 64)
    device = ["model.attn_implementation=sdpa", "engine.precision=bf16", "engine.zero_stage=2"]
    common = [
        f"data.train.path={pairs}", "data.eval=null", f"data.max_length={size['seq']}",
        f"data.max_prompt_length={size['prompt_tokens'] + 8}", f"train.micro_batch_size={size['pair_micro']}",
        f"train.global_batch_size={size['global_pairs']}",
        f"train.max_steps={size['warmup'] + size['steps'] + EXTRA_UPDATES}",
        "train.lr=1e-5", "train.warmup_steps=0", "train.lr_schedule=constant", "train.seed=0",
        "checkpoint.save_every=null",
        "checkpoint.save_final=false", "logging.progress_bar=false", "eval.every=null",
        "model.random_init=true", f"model.name_or_path={full}", *device,
    ]

    def run(section, run_id, title, recipe, extra=(), warmup=size["warmup"], steps=size["steps"], **kw):
        return dict(section=section, id=run_id, title=title, recipe=recipe, kind="train",
                    overrides=[*common, f"output_dir={workdir / run_id}", *extra], warmup=warmup, steps=steps, **kw)

    dpo, hl_dpo = "recipes/tiny/offline_dpo.yaml", "recipes/tiny/humanline_dpo.yaml"
    sft_rows = [f"data.train.path={sft}", "objective=sft", f"train.micro_batch_size={2 * size['pair_micro']}",
                f"train.global_batch_size={2 * size['global_pairs']}"]
    compare = [f"model.name_or_path={shallow}", f"train.max_steps={size['cmp_steps'] + EXTRA_UPDATES}",
               "engine.precision=fp32"]
    megatron = ["engine.name=megatron", "engine.zero_stage=0", "parallel.tp=1", "parallel.pp=1"]
    mix_data = workdir / "mix.jsonl"  # section 6: the long-tailed mix of bench/packing.py
    long_tailed_pairs(mix_data, size["mix_rows"], max_length=size["mix_seq"])
    mix = [f"data.train.path={mix_data}", f"data.max_length={size['mix_seq']}", "data.max_prompt_length=64"]
    trl = dict(model_dir=str(full), data=str(pairs), micro=size["pair_micro"], seq=size["seq"], lr=1e-5,
               accumulation=size["global_pairs"] // size["pair_micro"], warmup=size["warmup"], steps=size["steps"],
               bf16=not dry_run, spec=dict(dims, **({"num_layers": 2} if dry_run else {})))

    def trl_run(run_id, title, liger, section=7, **cfg):
        return dict(section=section, id=run_id, title=title, kind="trl", needs=TRL + (LIGER if liger else []),
                    trl=dict(trl, liger=liger, output_dir=str(workdir / run_id), **cfg),
                    **({"no_dry_run": "liger"} if liger else {}))

    plan = [
        run(1, "ds_z2_dpo", "DeepSpeed ZeRO-2 bf16, plain DPO", dpo),
        run(1, "ds_z2_hl_dpo", "DeepSpeed ZeRO-2 bf16, humanline DPO (k=1, clip)", hl_dpo),
        run(1, "ds_z2_sft", "DeepSpeed ZeRO-2 bf16, SFT", "recipes/_base/default.yaml", sft_rows),
        run(1, "ds_z2_hl_dpo_flash", "DeepSpeed ZeRO-2 bf16, humanline DPO, flash-attention 2", hl_dpo,
            ["model.attn_implementation=flash_attention_2"], needs=FLASH),
        run(2, "ds_z3_hl_dpo", "DeepSpeed ZeRO-3 (1 GPU) bf16, humanline DPO", hl_dpo, ["engine.zero_stage=3"]),
        run(2, "ds_z3_hl_dpo_gc", "DeepSpeed ZeRO-3 bf16, humanline DPO, gradient checkpointing", hl_dpo,
            ["engine.zero_stage=3", "model.gradient_checkpointing=true"]),
        run(3, "mg_hl_dpo_bf16", "Megatron-core tp=1 (DDP + distributed optimizer) bf16, humanline DPO", hl_dpo,
            megatron, needs=MEGATRON),
        run(3, "ds_z0_hl_dpo_fp32", f"DeepSpeed ZeRO-0 fp32, humanline DPO, {size['cmp_layers']} layers", hl_dpo,
            [*compare, "engine.zero_stage=0"], warmup=0, steps=size["cmp_steps"], tf32_off=True),
        run(3, "mg_hl_dpo_fp32", f"Megatron-core tp=1 fp32, humanline DPO, {size['cmp_layers']} layers", hl_dpo,
            [*compare, *megatron], warmup=0, steps=size["cmp_steps"], needs=MEGATRON, tf32_off=True),
        dict(section=4, id="ds_online_grpo", kind="online", recipe="recipes/tiny/online_grpo_math.yaml",
             title=f"online GRPO, {size['gen_prompts']} prompts x {size['gen_samples']} samples, "
                   f"{size['gen_tokens']} new tokens, ZeRO-2 bf16",
             overrides=[*common, f"output_dir={workdir / 'ds_online_grpo'}", f"data.train.path={prompts}",
                        "data.max_prompt_length=32", f"data.max_length={32 + size['gen_tokens']}",
                        f"rollout.num_generations={size['gen_samples']}",
                        f"rollout.max_new_tokens={size['gen_tokens']}",
                        "rollout.backend=hf", "rollout.every=1", f"train.micro_batch_size={size['gen_prompts']}",
                        f"train.global_batch_size={size['gen_prompts']}",
                        f"train.max_steps={1 + size['gen_updates'] + EXTRA_UPDATES}",
                        "model.gradient_checkpointing=true"],
             warmup=1, steps=size["gen_updates"], gen_prompts=size["gen_prompts"], gen_samples=size["gen_samples"]),
        run(5, "ds_z2_hl_dpo_fused",
            "DeepSpeed ZeRO-2 bf16, humanline DPO, log-probs from the hidden states (`train.fused_logprobs`)", hl_dpo,
            [FUSED]),
        run(5, "ds_z2_hl_dpo_compile",
            "DeepSpeed ZeRO-2 bf16, humanline DPO, compiled decoder layers (`train.compile`)", hl_dpo, [COMPILED],
            no_dry_run="compile"),
        run(5, "ds_z2_hl_dpo_liger", "DeepSpeed ZeRO-2 bf16, humanline DPO, Liger kernels (`model.kernels=liger`)",
            hl_dpo, [KERNELS],
            needs=LIGER, no_dry_run="liger"),
        run(5, "ds_z2_hl_dpo_fast", "DeepSpeed ZeRO-2 bf16, humanline DPO, fused log-probs + Liger kernels (compile is "
            "refused with Liger)", hl_dpo, [FUSED, KERNELS], needs=LIGER, no_dry_run="liger"),
        run(6, "ds_z2_hl_dpo_mix_padded", "DeepSpeed ZeRO-2 bf16, humanline DPO, long-tailed mix, padded (sdpa)",
            hl_dpo, mix),
        run(6, "ds_z2_hl_dpo_mix_packed",
            "DeepSpeed ZeRO-2 bf16, humanline DPO, long-tailed mix, packed (`attn_implementation=auto`)", hl_dpo,
            [*mix, "data.packing=true", "model.attn_implementation=auto"]),
        trl_run("trl_dpo", "TRL DPOTrainer (defaults), plain DPO", liger=False),
        trl_run("trl_dpo_liger", "TRL DPOTrainer, `use_liger_kernel=True`, plain DPO", liger=True),
        run(7, "ds_z2_dpo_fast", "ours: DeepSpeed ZeRO-2 bf16, plain DPO, fused log-probs + compiled layers", dpo,
            [FUSED, COMPILED],
            no_dry_run="compile"),
        run(7, "ds_z2_dpo_fast_liger", "ours: DeepSpeed ZeRO-2 bf16, plain DPO, fused log-probs + Liger kernels", dpo,
            [FUSED, KERNELS], needs=LIGER, no_dry_run="liger"),
        # section 8 (issue 40): humanline DPO with every switch that composes, beside TRL's fastest, in one call
        # the call's first run measured TRL at a third of its speed on 2026-11-27 (2.1 s updates against 0.70 s minutes
        # later): a throw-away run of the same configuration goes first, and no ratio reads it
        trl_run("s8_warmup_trl", "warm-up, not a measurement: TRL DPOTrainer with Liger, one update (the call's first "
                "process)", liger=True, section=8, warmup=0, steps=1),
        trl_run("s8_trl_dpo_liger", "TRL DPOTrainer, `use_liger_kernel=True`, plain DPO", liger=True, section=8),
        run(8, "s8_hl_dpo_fused_compile", "ours: humanline DPO (k=1, clip), fused log-probs (Liger's fused linear "
            "cross-entropy when installed) + compiled layers", hl_dpo, [FUSED, COMPILED], no_dry_run="compile"),
        run(8, "s8_hl_dpo_fused_liger", "ours: humanline DPO (k=1, clip), fused log-probs + Liger kernels (no compile: "
            "refused with Liger)", hl_dpo, [FUSED, KERNELS], needs=LIGER, no_dry_run="liger"),
        run(8, "s8_hl_dpo_fused", "ours: humanline DPO (k=1, clip), fused log-probs", hl_dpo, [FUSED]),
    ]
    for r in plan:
        if profile_dir and r["id"] in PROFILED:
            r["profile_dir"] = str(Path(profile_dir).resolve())
    return [r for r in plan if r["section"] in sections]


# ------------------------------------------------------------------------------------------ one run
def worker(runs: List[dict]) -> int:
    """Each run in turn: build its trainer, time its updates, print one result line (``RESULT_PREFIX`` + JSON with
    its id); the process group stays up between runs and goes with the process."""
    os.chdir(REPO)
    for run in runs:
        if run["kind"] == "trl":
            result = trl_dpo(run)
        else:
            result = _train_run(run)
        print(RESULT_PREFIX + json.dumps({"id": run["id"], **result}), flush=True)
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def _train_run(run: dict) -> dict:
    import torch

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if run.get("tf32_off"):  # for this run only: a dry run's batch runs others after it in this process
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    from hl_core.config import load_recipe
    from hl_core.trainer import Trainer

    recipe = load_recipe(REPO / run["recipe"], run["overrides"])
    trainer = Trainer(recipe)
    try:
        trainer.setup()
        return _measure(trainer, recipe, run)
    finally:
        trainer.close(destroy_process_group=False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _allocated_gib(engine):
    import torch

    return torch.cuda.memory_allocated(engine.device) / GIB if engine.device.type == "cuda" else None


def _measure(trainer, recipe, run: dict) -> dict:
    import torch

    from hl_core.config import reference_mode
    from hl_core.models.specs import resolve_spec
    from hl_core.preflight.plan import memory_plan

    engine = trainer.engine
    cuda = engine.device.type == "cuda"
    workdir = str(Path(run["overrides"][0].split("=", 1)[1]).parent)  # data.train.path=<workdir>/...
    result = {"recipe": run["recipe"], "overrides": [o.replace(workdir, "<workdir>") for o in run["overrides"]],
              "engine": recipe.engine.name, "precision": recipe.engine.precision, "objective": recipe.objective.name,
              "zero_stage": recipe.engine.zero_stage if recipe.engine.name == "deepspeed" else None,
              "gradient_checkpointing": recipe.model.gradient_checkpointing,
              "attention": recipe.model.attn_implementation,
              "setup_gib": _allocated_gib(engine)}
    if run["kind"] == "online":
        result.update(_sampler_throughput(trainer, run))
    rows = []
    for i in range(run["warmup"] + run["steps"]):
        if cuda and i == run["warmup"]:
            torch.cuda.reset_peak_memory_stats(engine.device)
        rows.append(trainer.train_step())
        if i == 0:
            result["steady_gib"] = _allocated_gib(engine)  # weights, optimizer states, reference
    measured = rows[run["warmup"]:]
    result["peak_gib"] = torch.cuda.max_memory_allocated(engine.device) / GIB if cuda else None
    if cuda:  # the extra updates come after the peak is read: the instrumented one resets it per call
        result["phase_gib"] = phase_memory(trainer, CudaProbe(engine.device))
    if run.get("profile_dir"):
        _profile(trainer, Path(run["profile_dir"]) / f"{run['id']}.txt", cuda)
    step_s = sum(r["step_time_s"] for r in measured)
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in measured)
    spec = resolve_spec(recipe.model)
    plan = memory_plan(recipe, world_size=engine.world_size, spec=spec)
    sequences = plan["sequences_per_micro_batch"] * plan["gradient_accumulation_steps"] * plan["dp"]
    result.update(
        params=spec.num_params(), updates_measured=len(measured), step_time_s=step_s / len(measured),
        tokens_per_update=tokens / len(measured), tokens_per_s=tokens / step_s,
        sync_frac=sum(r["sync_time_s"] for r in measured) / step_s,
        losses=[r["loss"] for r in rows], grad_norms=[r["grad_norm"] for r in rows],
        plan_gib={k: plan["gib"][k] for k in ("weights", "gradients", "optimizer", "reference", "logits")},
    )
    plan_g = plan["gib"]
    result["plan_gib"]["steady"] = plan_g["resident"]
    result["plan_gib"]["activations"] = plan_g["activations_checkpointed" if plan["gradient_checkpointing"]
                                               else "activations_full"]
    result["plan_gib"]["total"] = plan_g["total"]
    if run["kind"] == "online":
        rollout = sum(r.get("rollout_time_s", 0.0) for r in measured)
        result.update(rollout_share=rollout / step_s, train_tokens_per_s=tokens / max(step_s - rollout, 1e-9))
    elif recipe.engine.precision == "bf16":  # MFU against the bf16 peak (fp32 runs have none to compare)
        mean_len = result["tokens_per_update"] / sequences
        # policy forward + backward, and the reference's forward: by a second model (copy) or by the policy at each
        # sync over the batches up to the next (look-ahead: the same FLOPs, counted in the sync's time)
        passes = 3 + (1 if reference_mode(recipe)[0] in ("copy", "lookahead") else 0)
        result.update(mean_seq_len=mean_len, flops_per_token=passes * forward_flops_per_token(spec, mean_len))
    return result


def _profile(trainer, path: Path, cuda: bool) -> None:
    """Two updates under torch.profiler; the operators by self time (GPU time on a GPU) go to ``path``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            trainer.train_step()
    sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70) + "\n"
                    + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def _sampler_throughput(trainer, run: dict) -> dict:
    """The batched sampler alone: ``gen_prompts`` prompts x ``gen_samples`` samples in one decode loop, with the
    growing (dynamic) KV cache and the static one (a CUDA graph per decode step on a GPU); each timed on the second
    of two calls (the first warms up kernels and graphs). ``gen_tokens_per_s``: what ``rollout.kv_cache: auto``
    picks here."""
    engine, sampler = trainer.engine, trainer.source.sampler
    prompts = [trainer.train_data[i]["prompt_ids"] for i in range(run["gen_prompts"])]
    out, samples = {}, {}
    for kind in ("dynamic", "static"):
        sampler.cfg.kv_cache = kind
        for _ in range(2):
            engine.synchronize()
            start = time.perf_counter()
            groups = sampler.sample_groups(prompts, run["gen_samples"], list(range(len(prompts))))
            engine.synchronize()
            seconds = time.perf_counter() - start
        new = sum(len(c) for group in groups for c in group)
        out[f"gen_tokens_per_s_{kind}"], samples[kind] = new / seconds, groups
    sampler.cfg.kv_cache = "auto"
    auto = sampler.kv_cache(engine.device, lockstep=False)
    new = sum(len(c) for group in samples[auto] for c in group)
    return {"gen_rows": len(prompts) * run["gen_samples"], "gen_new_tokens": new, "gen_kv_cache": auto,
            "gen_tokens_per_s": out[f"gen_tokens_per_s_{auto}"], **out,
            "gen_static_vs_dynamic": out["gen_tokens_per_s_static"] / out["gen_tokens_per_s_dynamic"],
            "gen_static_same_samples": samples["static"] == samples["dynamic"]}


# ------------------------------------------------------------------------------------------ derived
def add_derived(result: dict, peak_tflops) -> dict:
    if result.get("flops_per_token") and peak_tflops:
        result["model_tflops"] = result["tokens_per_s"] * result["flops_per_token"] / 1e12
        result["mfu"] = result["model_tflops"] / peak_tflops
    plan = result.get("plan_gib")
    if plan and result.get("steady_gib") is not None:
        result["steady_vs_plan"] = result["steady_gib"] / plan["steady"] if plan["steady"] else None
        result["peak_vs_plan"] = result["peak_gib"] / plan["total"] if plan["total"] else None
    return result


def comparisons(by_id: Dict[str, dict], dry_run: bool) -> List[dict]:
    """Per-update losses of one run against another on the same weights and batches (``COMPARED``)."""
    out, floor = [], None
    for mine, theirs, precision, updates in COMPARED:
        a, b = by_id.get(mine), by_id.get(theirs)
        if a is None or b is None:
            continue
        row = {"section": 3, "kind": "comparison", "id": f"{mine}_vs_{theirs}", "precision": precision}
        if "losses" not in a or "losses" not in b:
            row["skipped"] = "a run did not finish: " + "; ".join(
                str(r.get("skipped") or r.get("error")) for r in (a, b) if "losses" not in r)
            out.append(row)
            continue
        n = min(len(a["losses"]), len(b["losses"]), updates or 10**9)
        diffs = [abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n])]
        row.update(updates=n, losses=a["losses"][:n], losses_against=b["losses"][:n],
                   grad_norms=a["grad_norms"][:n], grad_norms_against=b["grad_norms"][:n],
                   max_abs_loss_diff=max(diffs), tokens_per_s_ratio=a["tokens_per_s"] / b["tokens_per_s"])
        if (mine, theirs, precision, updates) == NOISE_FLOOR:
            row["noise_floor"] = True  # DeepSpeed against itself: what bf16 agreement can mean here
            floor = max(diffs)
        else:
            tolerance = TOLERANCE[precision]
            if precision == "bf16":
                tolerance = max(tolerance, 2 * floor) if floor is not None else tolerance
                # dry run on the CPU: megatron's CPU path steps bf16 weights with a torch optimizer (no fp32 master)
                tolerance *= 10 if dry_run else 1
            row.update(tolerance=tolerance, within_tolerance=max(diffs) <= tolerance)
        out.append(row)
    return out


SPEEDUPS = (("ds_z2_hl_dpo_fused", "ds_z2_hl_dpo"), ("ds_z2_hl_dpo_compile", "ds_z2_hl_dpo"),
            ("ds_z2_hl_dpo_liger", "ds_z2_hl_dpo"), ("ds_z2_hl_dpo_fast", "ds_z2_hl_dpo"),
            ("ds_z2_hl_dpo_mix_packed", "ds_z2_hl_dpo_mix_padded"))
OURS_DPO, TRL_DPO = ("ds_z2_dpo", "ds_z2_dpo_fast", "ds_z2_dpo_fast_liger"), ("trl_dpo", "trl_dpo_liger")
# section 8: each humanline run against TRL with Liger, and the fastest of them (goals: 1.3x or more at no more peak
# memory, 40% MFU)
OURS_HL_DPO = ("s8_hl_dpo_fused_compile", "s8_hl_dpo_fused_liger", "s8_hl_dpo_fused")
HL_GOALS = dict(tokens_per_s_ratio=1.3, peak_ratio=1.0, mfu=0.40)


def ratios(by_id: Dict[str, dict]) -> List[dict]:
    """Speed-ups measured in the same check (``kind: "ratio"``, no tolerance): each speed switch against the run
    without it (and, for log-probs from the hidden states, the largest per-update loss difference: bf16, so not
    zero), packed against padded on the long-tailed mix, and our fastest plain DPO run against TRL's fastest."""
    out = []
    for mine, theirs in SPEEDUPS:
        a, b = by_id.get(mine, {}), by_id.get(theirs, {})
        if a.get("tokens_per_s") and b.get("tokens_per_s"):
            row = _ratio_row(a, b, f"{mine}_vs_{theirs}")
            n = min(len(a["losses"]), len(b["losses"]))
            row["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n]))
            out.append(row)
    ours = [by_id[i] for i in OURS_DPO if by_id.get(i, {}).get("tokens_per_s")]
    trl = [by_id[i] for i in TRL_DPO if by_id.get(i, {}).get("tokens_per_s")]
    if ours and trl:
        best, best_trl = (max(runs, key=lambda r: r["tokens_per_s"]) for runs in (ours, trl))
        out.append(_ratio_row(best, best_trl, "ours_best_dpo_vs_trl_best_dpo"))
    trl_liger = by_id.get("s8_trl_dpo_liger", {})
    humanline = [by_id[i] for i in OURS_HL_DPO if by_id.get(i, {}).get("tokens_per_s")]
    if trl_liger.get("tokens_per_s") and humanline:
        for run in humanline:
            out.append(_ratio_row(run, trl_liger, f"{run['id']}_vs_s8_trl_dpo_liger"))
        row = _ratio_row(max(humanline, key=lambda r: r["tokens_per_s"]), trl_liger, "s8_best_hl_dpo_vs_trl_liger")
        row.update(mfu=row_mfu(by_id, row["run"]), mfu_against=row_mfu(by_id, row["against"]), goals=HL_GOALS)
        row["goals_met"] = {"tokens_per_s_ratio": row["tokens_per_s_ratio"] >= HL_GOALS["tokens_per_s_ratio"],
                            "peak_ratio": row["peak_ratio"] is not None and row["peak_ratio"] <= HL_GOALS["peak_ratio"],
                            "mfu": row["mfu"] is not None and row["mfu"] >= HL_GOALS["mfu"]}
        out.append(row)
    return out


def row_mfu(by_id: Dict[str, dict], run_id: str):
    return by_id.get(run_id, {}).get("mfu")


def _ratio_row(a: dict, b: dict, row_id: str) -> dict:
    peaks = (a.get("peak_gib"), b.get("peak_gib"))
    return {"section": a["section"], "kind": "ratio", "id": row_id, "run": a["id"], "against": b["id"],
            "tokens_per_s": a["tokens_per_s"], "tokens_per_s_against": b["tokens_per_s"],
            "tokens_per_s_ratio": a["tokens_per_s"] / b["tokens_per_s"], "peak_gib": peaks[0],
            "peak_gib_against": peaks[1],
            "peak_ratio": peaks[0] / peaks[1] if all(peaks) else None}


def _fmt(value, pattern="{:.2f}"):
    return "-" if value is None else pattern.format(value)


def markdown(results: List[dict]) -> str:
    env = results[0]
    lines = [f"GPU check on {env['gpu']} ({env['date']}, commit {env['git_commit']}; torch {env['torch']}, "
             f"CUDA {env['cuda']}, DeepSpeed {env['deepspeed']}, megatron-core {env['megatron-core']})", "",
             "| § | run | tokens/s | MFU | peak GiB (plan) | after 1st update GiB (plan) | sync % of step | note |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results[1:]:
        if r.get("kind") in ("comparison", "ratio"):
            continue
        note = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("error") and "failed (see the JSON)" or ""
        if r.get("gen_tokens_per_s"):
            note = (f"sampler {r['gen_tokens_per_s']:,.0f} new tokens/s ({r['gen_rows']} rows, {r['gen_kv_cache']} KV "
                    f"cache; static / dynamic {r['gen_static_vs_dynamic']:.2f}x); rollout "
                    f"{100 * r['rollout_share']:.0f}% "
                    "of an update")
        plan = r.get("plan_gib") or {}
        lines.append(
            f"| {r['section']} | {r['title']} | {_fmt(r.get('tokens_per_s'), '{:,.0f}')} | "
            f"{_fmt(r.get('mfu'), '{:.1%}')} "
            f"| {_fmt(r.get('peak_gib'))} ({_fmt(plan.get('total'))}) | {_fmt(r.get('steady_gib'))} "
            f"({_fmt(plan.get('steady'))}) | {_fmt(r.get('sync_frac') and 100 * r['sync_frac'], '{:.2f}')} | {note} |")
    for r in results[1:]:
        if r.get("kind") == "ratio":
            lines.append("")
            lines.append(f"{r['run']} / {r['against']}: tokens/s {r['tokens_per_s']:,.0f} / "
                         f"{r['tokens_per_s_against']:,.0f} = "
                         f"{r['tokens_per_s_ratio']:.2f}x; peak GiB {_fmt(r['peak_gib'])} / "
                         f"{_fmt(r['peak_gib_against'])}"
                         + (f" = {r['peak_ratio']:.2f}x" if r.get("peak_ratio") else "")
                         + (f"; MFU {_fmt(r['mfu'], '{:.1%}')} / {_fmt(r.get('mfu_against'), '{:.1%}')}" if "mfu" in r
                            else "")
                         + (f"; goals met: {r['goals_met']}" if "goals_met" in r else "")
                         + (f"; max |loss difference| {r['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in r
                            else ""))
    for r in results[1:]:
        if r.get("kind") == "comparison" and "max_abs_loss_diff" in r:
            lines.append("")
            lines.append(f"{r['id']} ({r['precision']}, {r['updates']} updates): max |loss difference| "
                         f"{r['max_abs_loss_diff']:.2e} ("
                         + ("the bf16 noise floor" if r.get("noise_floor") else f"tolerance {r['tolerance']:.1e}")
                         + "): "
                         f"{', '.join(f'{x:.5f}' for x in r['losses'])} vs "
                         f"{', '.join(f'{x:.5f}' for x in r['losses_against'])}; tokens/s ratio "
                         f"{r['tokens_per_s_ratio']:.2f}")
    return "\n".join(lines) + "\n"
