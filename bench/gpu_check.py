"""The GPU check: what our engines do on one CUDA GPU (sections 1-4 in about 6 minutes on an H100).

    python bench/gpu_check.py                      # on a machine with a CUDA GPU
    python bench/gpu_check.py --dry-run            # every section on the CPU at tiny size, one update each
    python bench/gpu_check.py --sections 1 3 --out runs/gpu_check/part.jsonl --markdown runs/gpu_check/part.md

Sections (a Llama-3.2-1B-shaped random-init model at full depth, bf16, sequences of 1024 tokens):

1. DeepSpeed ZeRO-2: plain DPO, humanline DPO (k = 1, clip [-1.5, 1.5]) and SFT; flash-attention 2
   when installed.
2. ZeRO-3 on one GPU, without and with gradient checkpointing (humanline DPO).
3. The megatron engine on the GPU path (megatron-core DDP + distributed optimizer, tp = 1): humanline
   DPO against DeepSpeed on the same weights and batches, bf16 at full depth and fp32 at 2 layers
   (TF32 off), per-update losses compared.
4. Online GRPO: the batched sampler's throughput (new tokens/s) at 16 prompts x 8 samples, with the growing
   KV cache and the static one (CUDA graphs; `rollout.kv_cache`), and the share of an online update spent in
   the rollout.
5. The speed switches on humanline DPO, each alone and together: log-probs from the hidden states
   (`train.fused_logprobs`), compiled decoder layers (`train.compile`), Liger kernels (`model.kernels=liger`,
   when liger-kernel is installed); tokens/s and peak memory against section 1's run without them.
6. Packed against padded micro-batches on bench/packing.py's long-tailed mix (sequences up to 2048 tokens):
   `data.packing` with `model.attn_implementation=auto` (flash-attention's variable-length path, or
   FlexAttention's document mask) against padded sdpa; real tokens/s and peak memory.
7. TRL's DPOTrainer (its defaults, and `use_liger_kernel=True`) against our plain DPO with the speed switches
   (and section 1's plain DPO), same model, rows, micro-batch and accumulation: tokens/s and peak memory of
   each, and our fastest over TRL's fastest (``bench/gpu_check_trl.py``).

8. Humanline DPO with every speed switch that composes beside TRL's DPOTrainer with `use_liger_kernel=True`, in one
   call (issue 40): fused log-probs + compiled layers (Liger's fused linear cross-entropy computes the log-probs
   when liger-kernel is installed), fused log-probs + Liger kernels (compile and Liger kernels together are
   refused), fused log-probs alone; tokens/s, MFU and peak memory of each, and the ratios against TRL with Liger
   (goals: 40% MFU, 1.3x TRL's tokens/s or more at no more than its peak memory). Measured 2026-11-27, before the
   fused path's blocks were resized (docs/perf/gpu_check_h100_2026-11-27.md); to bound the
   call to 8 minutes: `python bench/gpu_check.py --sections 8 --time-budget 270 --run-timeout 200 --out
   docs/perf/gpu_check_h100_<date>_s8.jsonl --markdown docs/perf/gpu_check_h100_<date>_s8.md` (no run starts after
   240 s, none runs past 200 s: at most about 7.5 minutes; the runs go in order of importance, TRL first, after a
   throw-away one-update TRL run: the call's first run measured TRL at a third of its speed on 2026-11-27).

Sections 1-4 fit one 10-minute call and 5-7 another (`--sections 5 6 7`), 8 one of its own; the ratios of sections 5 and
7 against section 1's runs are printed only when those ran in the same call. A dry run leaves out the runs that
need a GPU-only package or minutes of CPU compilation (``"skipped"`` with the reason).

Every run is its own process (a failure or an out-of-memory stays in its section; peak memory is its
own). One JSON line per result is printed and written to ``--out``; ``--markdown`` writes the table
docs/perf keeps. No GPU and no ``--dry-run``: exit 2. A missing optional package (megatron-core,
flash-attn) turns its runs into ``"skipped": "<why>"`` lines and the rest runs. Exit 1 when a run
failed or a comparison is outside its tolerance.

Reported per training run: ``tokens_per_s`` (real tokens of all sequences the policy trains on, per
second of whole optimizer updates: data, forwards, backward, sync, optimizer step), ``mfu`` (model
FLOPs per second over the GPU's dense bf16 peak; FLOPs from ``bench.shapes.forward_flops_per_token``:
3 forward-equivalents for the policy's forward + backward, 1 for the reference forward; gradient
checkpointing's recomputation is not counted), ``peak_gib`` (``torch.cuda.max_memory_allocated`` over
the measured updates), ``steady_gib`` (allocated after the first update: weights, optimizer states,
reference) beside the ``--plan`` estimate for the same recipe, and ``sync_frac`` (reference sync time
over update time, CUDA-synchronised). Speed-ups measured in the same call are ``"kind": "ratio"`` lines
(tokens/s and peak memory of a run over another; no tolerance).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import gpu_check_runs as runs_mod  # noqa: E402
from hl_core import children  # noqa: E402 (the runs end with this script)
from hl_core.config.checks import installed  # noqa: E402

# dense bf16 peak (TFLOP/s) by the name torch reports; --peak-tflops overrides
PEAK_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("GH200", 989.4), ("A100", 312.0),
                    ("L40S", 362.1), ("A10G", 70.0), ("L4", 121.0))
TIME_BUDGET_S = 540  # the whole check, start-ups included: runs that would start after it are skipped
SECTIONS = (1, 2, 3, 4, 5, 6, 7, 8)  # about 18 minutes on an H100: three calls, `1 2 3 4`, `5 6 7` and `8`


def peak_tflops(gpu_name: str):
    for key, value in PEAK_BF16_TFLOPS:
        if key in gpu_name:
            return value
    return None


def environment(args) -> dict:
    import torch

    def version(name):
        try:
            from importlib.metadata import version as v

            return v(name)
        except Exception:
            return None

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (dry run)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    # the sources measured, by content (a copy of the tree may carry a stale or no git HEAD)
    digest = hashlib.sha256()
    for path in sorted(p for d in ("hl_core", "bench", "launchers") for p in (REPO / d).rglob("*.py")):
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return {
        "kind": "environment", "gpu": gpu, "dry_run": args.dry_run,
        "peak_bf16_tflops": args.peak_tflops or peak_tflops(gpu), "date": datetime.date.today().isoformat(),
        "git_commit": commit or None, "source_sha256": digest.hexdigest()[:16], "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{name: version(name) for name in ("deepspeed", "transformers", "megatron-core", "flash-attn")},
    }


def run_workers(runs: list, workdir: Path, timeout: float) -> list:
    """``runs`` one after another in one process of their own (one run, except in a dry run: see ``batchable``); the
    process's output goes to ``workdir/<id>.log`` of each. One result per run, an ``"error"`` for a run that printed
    none."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(runs)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    try:
        proc = children.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout * len(runs), env=env)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output, code = output + f"\n[timed out after {timeout * len(runs):.0f}s]", None
    printed = {}
    for line in output.splitlines():
        if line.startswith(runs_mod.RESULT_PREFIX):
            row = json.loads(line[len(runs_mod.RESULT_PREFIX):])
            printed[row["id"]] = row
    wall = round((time.perf_counter() - start) / len(runs), 1)  # a batch's runs share its wall time
    tail = [line for line in output.strip().splitlines() if line.strip()][-3:]
    why = "timed out" if code is None else f"exit code {code}"
    results = []
    for run in runs:
        log = workdir / f"{run['id']}.log"
        log.write_text(output)
        base = {"section": run["section"], "id": run["id"], "title": run["title"], "wall_s": wall}
        results.append({**base, **printed[run["id"]]} if run["id"] in printed else
                       {**base, "error": f"{why}: {' | '.join(tail)[-600:]}", "log": str(log)})
    return results


def batchable(run: dict) -> bool:
    """A dry run starts one process for all consecutive runs of ours, DeepSpeed and megatron (each its own trainer,
    megatron's parallel state torn down at its close; the process start-up and imports are most of a toy run's
    time), the runs it skips in between not breaking the batch; TRL (its own launcher state) keeps a process. A run
    that switches TF32 off joins too (``_train_run`` switches it back after the run)."""
    return run["kind"] in ("train", "online")


def missing_package(run: dict):
    """Why ``run`` cannot run here (an optional package it needs is not installed), or None."""
    for module, label in run.get("needs", []):
        if not installed(module):
            return f"{label} is not installed"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, one update per run")
    parser.add_argument("--sections", type=int, nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--out", default="runs/gpu_check/results.jsonl", help="JSON lines written here")
    parser.add_argument("--markdown", default=None, help="also write the results as a Markdown table here")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, for MFU")
    parser.add_argument("--run-timeout", type=float, default=240.0, help="seconds one run may take")
    parser.add_argument("--time-budget", type=float, default=TIME_BUDGET_S,
                        help="seconds after which no run starts (the call ends within about this plus --run-timeout)")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="also profile two updates of the humanline DPO runs (DeepSpeed, megatron) into DIR")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return runs_mod.worker(json.loads(args.worker))  # a list of runs

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU is visible to PyTorch (torch.cuda.is_available() is False); run it on a GPU "
              "machine, or pass --dry-run to exercise every section on the CPU at tiny size.", file=sys.stderr)
        return 2
    env = environment(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = [env]
    print(json.dumps(env), flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        workdir = Path(tmp)
        plan = runs_mod.plan_runs(workdir, dry_run=args.dry_run, sections=args.sections, profile_dir=args.profile)
        by_id, batch = {}, []  # batch: (run, why it is skipped or None) for one process, in the plan's order

        def record(result):
            by_id[result["id"]] = result
            results.append(result)
            print(json.dumps(result), flush=True)

        def flush():
            todo = [run for run, why in batch if why is None]
            done = iter(run_workers(todo, workdir, args.run_timeout) if todo else [])
            for run, why in batch:
                if why is None:
                    record(runs_mod.add_derived(next(done), env["peak_bf16_tflops"]))
                else:
                    record({"section": run["section"], "id": run["id"], "title": run["title"], "skipped": why})
            batch.clear()

        for run in plan:
            why = missing_package(run) or (runs_mod.NO_DRY_RUN[run["no_dry_run"]] if args.dry_run
                                           and run.get("no_dry_run") else None)
            left = args.time_budget - (time.perf_counter() - started)
            if why is None and not args.dry_run and left < 30:
                why = f"the check's {args.time_budget:.0f}s time budget is spent"
            alone = not (args.dry_run and (why is not None or batchable(run)))
            if alone:
                flush()
            batch.append((run, why))
            if alone:
                flush()
        flush()
        for comparison in runs_mod.comparisons(by_id, dry_run=args.dry_run) + runs_mod.ratios(by_id):
            results.append(comparison)
            print(json.dumps(comparison), flush=True)
        logs = {p.name: p.read_text() for p in workdir.glob("*.log")}
    with out.open("w") as handle:
        for row in results:
            handle.write(json.dumps(row) + "\n")
    failed = [r for r in results if r.get("error")]
    for r in failed:  # the last lines of a failed run's log, for the reader of a one-shot check
        print(f"--- {r['id']} log tail ---\n" + "\n".join(logs.get(f"{r['id']}.log", "").splitlines()[-25:]),
              file=sys.stderr)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(runs_mod.markdown(results))
    bad = failed + [r for r in results if r.get("kind") == "comparison" and not r.get("within_tolerance", True)]
    print(f"gpu_check: {len(results) - 1} results in {out} ({len(failed)} failed, "
          f"{sum(1 for r in results if r.get('skipped'))} skipped) in {time.perf_counter() - started:.0f}s", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
