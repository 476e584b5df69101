"""Humanline DPO with LoRA against full fine-tuning with a reference copy and against plain SFT: peak memory per
process and step time, one subprocess per mode, ratios from one run.

    python bench/lora.py                                   # 3 timed updates per mode (about 4 minutes on 2 busy cores)
    python bench/lora.py --updates 5 --out docs/perf/lora_cpu.json

Modes (one process each, so each peak is that mode's own; run one after another on the same machine):

* ``lora_humanline_dpo``: humanline DPO (k = 1, clip) with LoRA r=16 on every attention and MLP projection;
  the reference is the base plus a frozen adapter copy, synced every update;
* ``full_humanline_dpo``: the same humanline DPO, full fine-tuning: the reference is a second model;
* ``sft``: plain SFT, full fine-tuning, no reference, on the chosen completions (one sequence per example where
  DPO has two).

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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.memprobe import CPU_ALLOCATOR_ENV, GIB, RssProbe  # noqa: E402

MODES = ("lora_humanline_dpo", "full_humanline_dpo", "sft")
LORA = ["model.lora.r=16", "model.lora.alpha=32",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"]
MAX_LENGTH, COMPLETION_TOKENS = 160, 120


def mode_overrides(mode: str, workdir: Path) -> list:
    data = workdir / ("sft.jsonl" if mode == "sft" else "pairs.jsonl")
    out = [f"data.train.path={data}"]
    if mode == "lora_humanline_dpo":
        out += LORA + ["train.lr=1e-4"]
    if mode == "sft":
        out += ["objective=sft", "humanline.transform=none", "humanline.sync_every=null"]
    return out


def run_mode(mode: str, workdir: Path, updates: int, micro: int) -> dict:
    """In this process: build the trainer, one untimed update, ``updates`` timed ones; memory and times."""
    probe = RssProbe()
    import torch

    from hl_core.config import load_recipe
    from hl_core.trainer import Trainer

    torch.set_num_threads(os.cpu_count() or 1)
    baseline = probe.current()
    recipe = load_recipe(REPO / "recipes" / "tiny" / "humanline_dpo.yaml", [
        f"model.name_or_path={workdir / 'model'}", "model.attn_implementation=sdpa", "data.eval=null",
        "eval.every=null", f"data.max_length={MAX_LENGTH}", "data.max_prompt_length=32", "data.shuffle=false",
        f"train.micro_batch_size={micro}", f"train.max_steps={updates + 1}", "train.lr=1e-5", "train.warmup_steps=0",
        "checkpoint.save_every=null", "checkpoint.save_final=false", f"output_dir={workdir / mode}",
        "logging.progress_bar=false", *mode_overrides(mode, workdir)])
    trainer = Trainer(recipe)
    trainer.setup()
    engine = trainer.engine
    module = engine.policy.module
    counts = {
        "params": sum(p.numel() for p in module.parameters()),
        "trainable_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
        "reference_params": (sum(p.numel() for p in engine.reference.module.parameters())
                             if engine.reference is not None else sum(r.numel() for _, _, r in engine._pairs)),
    }
    trainer.train_step()  # allocates the optimizer states: not timed
    at_rest = probe.current()
    seconds, losses, sync_bytes = [], [], engine.last_sync_bytes
    for _ in range(updates):
        start = time.perf_counter()
        row = trainer.train_step()
        seconds.append(time.perf_counter() - start)
        losses.append(row["loss"])
    trainer.close()
    peak = probe.peak()
    return {"mode": mode, **counts, "step_s": sum(seconds) / len(seconds), "step_s_each": seconds, "losses": losses,
            "sync_bytes": sync_bytes, "baseline_gib": baseline / GIB, "at_rest_gib": at_rest / GIB,
            "process_peak_gib": peak / GIB, "peak_above_baseline_gib": (peak - baseline) / GIB}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=3, help="timed updates per mode")
    parser.add_argument("--micro-batch", type=int, default=2, help="examples (pairs for DPO) per update")
    parser.add_argument("--out", default=None, help="also write the result as JSON here")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a child process: one mode
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args.mode, Path(args.workdir), args.updates, args.micro_batch)))
        return 0

    from bench.shapes import spec_of, write_model_dir, write_rows

    spec = spec_of("llama3.2-1b", num_layers=4, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                   vocab_size=8192, head_dim=None)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        write_model_dir(spec, workdir / "model")
        rows = (args.updates + 2) * args.micro_batch
        write_rows(workdir / "pairs.jsonl", "pairs", rows, COMPLETION_TOKENS)
        write_rows(workdir / "sft.jsonl", "sft", rows, COMPLETION_TOKENS)
        env = {**os.environ, **CPU_ALLOCATOR_ENV, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--workdir", str(workdir),
                                   "--updates", str(args.updates), "--micro-batch", str(args.micro_batch)],
                                  env=env, capture_output=True, text=True, cwd=REPO)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode or line is None:
                print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
                return 1
            results[mode] = json.loads(line[len("RESULT "):])
            r = results[mode]
            print(f"{mode:20s} peak {r['process_peak_gib']:.3f} GiB ({r['peak_above_baseline_gib']:.3f} above "
                  f"imports), at rest {r['at_rest_gib']:.3f} GiB, step {r['step_s']:.2f}s", flush=True)
    import torch

    lora, full, sft = (results[m] for m in MODES)
    ratio = lambda key, a, b: a[key] / b[key]  # noqa: E731
    summary = {
        "lora_vs_full_humanline": {"peak": ratio("process_peak_gib", lora, full),
                                   "peak_above_baseline": ratio("peak_above_baseline_gib", lora, full),
                                   "step_time": ratio("step_s", lora, full)},
        "lora_humanline_vs_sft": {"peak": ratio("process_peak_gib", lora, sft),
                                  "peak_above_baseline": ratio("peak_above_baseline_gib", lora, sft),
                                  "step_time": ratio("step_s", lora, sft)},
        "full_humanline_vs_sft": {"peak": ratio("process_peak_gib", full, sft),
                                  "peak_above_baseline": ratio("peak_above_baseline_gib", full, sft),
                                  "step_time": ratio("step_s", full, sft)},
    }
    result = {"model": {"shape": "llama3.2-1b narrowed", "hidden": spec.hidden_size, "layers": spec.num_layers,
                        "vocab": spec.vocab_size, "params": full["params"]},
              "setup": {"precision": "fp32", "zero_stage": 0, "micro_batch": args.micro_batch, "max_length": MAX_LENGTH,
                        "completion_tokens": COMPLETION_TOKENS, "timed_updates": args.updates, "lora": LORA},
              "modes": results, "ratios": summary, "cpu_count": os.cpu_count(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d")}
    print("\n| ratio | peak (process) | peak above imports | step time |\n|---|---|---|---|")
    for name, r in summary.items():
        print(f"| {name} | {r['peak']:.2f}x | {r['peak_above_baseline']:.2f}x | {r['step_time']:.2f}x |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
