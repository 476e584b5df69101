"""The reference without a second copy of the weights, side by side: peak memory per process and step time of
humanline DPO with a reference copy, with look-ahead syncing, with LoRA, of a frozen reference live and cached,
and of plain SFT; one subprocess per mode, ratios from one run.

    python bench/reference.py                      # 4 timed updates per mode, modes interleaved twice (~10 min)
    python bench/reference.py --updates 6 --repeats 3 --out docs/perf/reference_cpu.json

Modes (one process each, so each peak is that mode's own; run one after another, the whole list ``--repeats``
times, interleaved, and each mode's step time is the median over its repeats, so a slow spell of a busy machine
does not land on one mode only):

* ``sft``: plain SFT, full fine-tuning, no reference, on the chosen completions (one sequence per example where
  DPO has two);
* ``copy_humanline_dpo``: humanline DPO (k = 1, clip), full fine-tuning, the reference a second model
  (``humanline.reference: copy``);
* ``lookahead_humanline_dpo``: the same with look-ahead syncing: no second model, the policy computes the next
  update's reference log-probs at each sync;
* ``lora_humanline_dpo``: humanline DPO with LoRA r=16 on every attention and MLP projection, the reference the base
  plus a frozen adapter copy synced every update;
* ``frozen_dpo_copy`` / ``frozen_dpo_cached``: DPO with the humanline clamp and a frozen reference, as a second model
  or as log-probs computed once before training (``train.cache_reference_logps``; the precompute is in setup, not in
  the step time, and reported apart).

Model: a Llama-3.2-1B-shaped model narrowed to what a 2-core CPU trains in seconds (hidden 768, 4 layers, 12 heads
/ 4 KV heads, MLP 2048, vocabulary 8192, tied embeddings, random init, sdpa), fp32, DeepSpeed ZeRO-0, through our
trainer. Memory is the process's resident set as the kernel counts it: the high-water mark ``VmHWM`` over the whole
process (imports, model build, every update), and that peak minus the resident set after imports (``baseline``,
before any model exists); glibc is told to return large blocks (``bench.memprobe.CPU_ALLOCATOR_ENV``), so the
resident set follows live tensors. Step time: the mean of the timed updates after one untimed update (which
allocates the optimizer states).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.memprobe import CPU_ALLOCATOR_ENV, GIB, RssProbe  # noqa: E402
from hl_core import children  # noqa: E402 (each mode's process ends with this script)
from hl_core.humanline import ParameterPairs  # noqa: E402

MODES = ("sft", "copy_humanline_dpo", "lookahead_humanline_dpo", "lora_humanline_dpo", "frozen_dpo_copy",
         "frozen_dpo_cached")
LORA = ["model.lora.r=16", "model.lora.alpha=32",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]
MAX_LENGTH, COMPLETION_TOKENS = 160, 120


def mode_overrides(mode: str, workdir: Path) -> list:
    data = workdir / ("sft.jsonl" if mode == "sft" else "pairs.jsonl")
    out = [f"data.train.path={data}"]
    out += {
        "sft": ["objective=sft", "humanline.transform=none", "humanline.sync_every=null"],
        "copy_humanline_dpo": ["humanline.reference=copy"],
        "lookahead_humanline_dpo": ["humanline.reference=lookahead"],
        "lora_humanline_dpo": [*LORA, "train.lr=1e-4", "humanline.reference=copy"],
        "frozen_dpo_copy": ["humanline.sync_every=null"],
        "frozen_dpo_cached": ["humanline.sync_every=null", "train.cache_reference_logps=true"],
    }[mode]
    return out


def mode_recipe(mode: str, workdir: Path, updates: int, micro: int, out: Path = None):
    from hl_core.config import load_recipe

    return load_recipe(REPO / "recipes" / "tiny" / "humanline_dpo.yaml", [
        f"model.name_or_path={workdir / 'model'}", "model.attn_implementation=sdpa", "data.eval=null",
        "eval.every=null", f"data.max_length={MAX_LENGTH}", "data.max_prompt_length=32", "data.shuffle=false",
        f"train.micro_batch_size={micro}", f"train.max_steps={updates + 1}", "train.lr=1e-5", "train.warmup_steps=0",
        "checkpoint.save_every=null", "checkpoint.save_final=false", f"output_dir={(out or workdir) / mode}",
        "logging.progress_bar=false", *mode_overrides(mode, workdir)])


def paired_steps(modes, workdir: Path, updates: int, micro: int) -> dict:
    """In this process: both modes' trainers, one untimed update each, then ``updates`` timed ones alternating
    (A, B, A, B, ...), so machine noise hits both alike; the median of the per-update ratios B / A."""
    import torch

    from hl_core.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    trainers = [Trainer(mode_recipe(m, workdir, updates, micro, out=workdir / "paired")) for m in modes]
    for trainer in trainers:
        trainer.setup()
        trainer.train_step()
    seconds = [[], []]
    for _ in range(updates):
        for index, trainer in enumerate(trainers):
            start = time.perf_counter()
            trainer.train_step()
            seconds[index].append(time.perf_counter() - start)
    for index, trainer in enumerate(trainers):
        trainer.close(destroy_process_group=index == len(trainers) - 1)
    ratios = [b / a for a, b in zip(*seconds)]
    return {"modes": list(modes), "step_s": seconds, "median_ratio": statistics.median(ratios), "ratios": ratios}


def run_mode(mode: str, workdir: Path, updates: int, micro: int) -> dict:
    """In this process: build the trainer, one untimed update, ``updates`` timed ones; memory and times."""
    probe = RssProbe()
    import torch

    from hl_core.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    baseline = probe.current()
    recipe = mode_recipe(mode, workdir, updates, micro)
    trainer = Trainer(recipe)
    setup_start = time.perf_counter()
    trainer.setup()  # a cached reference computes its log-probs here
    setup_s = time.perf_counter() - setup_start
    engine = trainer.engine
    module = engine.policy.module
    pairs = engine.reference_pairs() if engine.has_reference else ParameterPairs([])
    counts = {
        "params": sum(p.numel() for p in module.parameters()),
        "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "reference_params": (sum(p.numel() for p in engine.reference.module.parameters())
                             if engine.reference is not None else sum(r.numel() for _, _, r in pairs)),
    }
    trainer.train_step()  # allocates the optimizer states: not timed
    at_rest = probe.current()
    seconds, losses = [], []
    sync_bytes = pairs.shard_bytes() if trainer.recipe.humanline.sync_every else 0
    for _ in range(updates):
        start = time.perf_counter()
        row = trainer.train_step()
        seconds.append(time.perf_counter() - start)
        losses.append(row["loss"])
    mode_used = trainer.reference.mode
    trainer.close()
    peak = probe.peak()
    return {"mode": mode, "reference_mode": mode_used, "setup_s": setup_s, **counts, "step_s": sum(seconds)
            / len(seconds), "step_s_each": seconds, "losses": losses,
            "sync_bytes": sync_bytes, "baseline_gib": baseline / GIB, "at_rest_gib": at_rest / GIB,
            "process_peak_gib": peak / GIB, "peak_above_baseline_gib": (peak - baseline) / GIB}


RATIOS = {  # name: (mode, against); a paired run `against,mode` gives the same ratio measured alternately
    "lookahead_vs_copy": ("lookahead_humanline_dpo", "copy_humanline_dpo"),
    "lookahead_vs_sft": ("lookahead_humanline_dpo", "sft"),
    "copy_vs_sft": ("copy_humanline_dpo", "sft"),
    "lora_vs_copy": ("lora_humanline_dpo", "copy_humanline_dpo"),
    "lora_vs_sft": ("lora_humanline_dpo", "sft"),
    "cached_vs_live_frozen": ("frozen_dpo_cached", "frozen_dpo_copy"),
}


PAIRED = (("copy_humanline_dpo", "lookahead_humanline_dpo"), ("frozen_dpo_copy", "frozen_dpo_cached"),
          ("copy_humanline_dpo", "lora_humanline_dpo"))


def run_child(mode: str, workdir: Path, args, env, updates=None) -> dict:
    proc = children.run([sys.executable, __file__, "--mode", mode, "--workdir", str(workdir), "--updates",
                           str(updates or args.updates), "--micro-batch", str(args.micro_batch)],
                          env=env, capture_output=True, text=True, cwd=REPO)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise RuntimeError(f"mode {mode} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=4, help="timed updates per mode and repeat")
    parser.add_argument("--repeats", type=int, default=2, help="times the whole mode list runs, interleaved")
    parser.add_argument("--micro-batch", type=int, default=2, help="examples (pairs for DPO) per update")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    parser.add_argument("--paired-updates", type=int, default=8, help="alternating timed updates per paired run")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # a child process: one mode, or `A,B` (paired)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        workdir = Path(args.workdir)
        result = (paired_steps(args.mode.split(","), workdir, args.updates, args.micro_batch) if "," in args.mode
                  else run_mode(args.mode, workdir, args.updates, args.micro_batch))
        print("RESULT " + json.dumps(result))
        return 0

    from bench.shapes import spec_of, write_model_dir, write_rows

    spec = spec_of("llama3.2-1b", num_layers=4, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                   vocab_size=8192, head_dim=None)
    runs = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_model_dir(spec, workdir / "model")
        rows = (args.updates + 2) * args.micro_batch
        write_rows(workdir / "pairs.jsonl", "pairs", rows, COMPLETION_TOKENS)
        write_rows(workdir / "sft.jsonl", "sft", rows, COMPLETION_TOKENS)
        env = {**os.environ, **CPU_ALLOCATOR_ENV, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        for repeat in range(args.repeats):
            for mode in MODES:
                try:
                    r = run_child(mode, workdir, args, env)
                except RuntimeError as exc:
                    print(exc, file=sys.stderr)
                    return 1
                runs[mode].append(r)
                print(f"[{repeat + 1}/{args.repeats}] {mode:24s} ({r['reference_mode']}) peak "
                      f"{r['process_peak_gib']:.3f} "
                      f"GiB ({r['peak_above_baseline_gib']:.3f} above imports), step {r['step_s']:.2f}s, setup "
                      f"{r['setup_s']:.1f}s", flush=True)
        paired = {}
        for a, b in PAIRED:
            r = run_child(f"{a},{b}", workdir, args, env, updates=args.paired_updates)
            paired[f"{b}_vs_{a}"] = r
            print(f"paired {b} / {a}: median per-update step-time ratio {r['median_ratio']:.3f} "
                  f"({args.paired_updates} alternating updates)", flush=True)
    import torch

    results = {}
    for mode, rs in runs.items():
        results[mode] = {**rs[0], "step_s": statistics.median(r["step_s"] for r in rs),
                         "step_s_repeats": [r["step_s"] for r in rs],
                         "process_peak_gib": max(r["process_peak_gib"] for r in rs),
                         "peak_above_baseline_gib": max(r["peak_above_baseline_gib"] for r in rs),
                         "setup_s": statistics.median(r["setup_s"] for r in rs)}
    ratio = lambda key, a, b: results[a][key] / results[b][key]  # noqa: E731
    summary = {name: {"peak": ratio("process_peak_gib", a, b),
                      "peak_above_baseline": ratio("peak_above_baseline_gib", a, b),
                      "step_time": ratio("step_s", a, b)} for name, (a, b) in RATIOS.items()}
    result = {"model": {"shape": "llama3.2-1b narrowed", "hidden": spec.hidden_size, "layers": spec.num_layers,
                        "vocab": spec.vocab_size, "params": results["copy_humanline_dpo"]["params"]},
              "setup": {"precision": "fp32", "zero_stage": 0, "micro_batch": args.micro_batch, "max_length": MAX_LENGTH,
                        "completion_tokens": COMPLETION_TOKENS, "timed_updates": args.updates, "repeats": args.repeats,
                        "lora": LORA},
              "modes": results, "ratios": summary, "paired_step_time": paired, "cpu_count": os.cpu_count(),
              "load_average": os.getloadavg(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    print("\n| ratio | peak (process) | peak above imports | step time (separate runs) | step time (paired) |\n"
          "|---|---|---|---|---|")
    for name, r in summary.items():
        a, b = RATIOS[name]
        pair = paired.get(f"{a}_vs_{b}")
        shown = f"{pair['median_ratio']:.2f}x" if pair else "—"
        print(f"| {name} | {r['peak']:.2f}x | {r['peak_above_baseline']:.2f}x | {r['step_time']:.2f}x | {shown} |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
