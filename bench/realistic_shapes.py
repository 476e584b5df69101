"""Realistic shapes on the CPU: the recipes' models at their exact widths (hidden size, heads, KV heads,
intermediate size, 128k / 152k / 256k vocabularies, tied or untied embeddings), depth cut to 1-2 layers,
through our own trainer and engines; measured memory beside what ``--plan`` predicts.

    python bench/realistic_shapes.py                         # everything (about 17 minutes on 2 cores)
    python bench/realistic_shapes.py --sections hidden       # one section: logprobs, hidden, train, forward
    python bench/realistic_shapes.py --sections hidden --hidden-width 32 --markdown docs/perf/x.md

Sections:
- ``logprobs``: token log-probs over bf16 logits at each vocabulary: peak memory of ours against a plain
  float32 ``log_softmax`` over ``[B, T, V]`` (forward + backward, beyond the logits), max |difference| of
  values and gradients.
- ``hidden``: ``train.fused_logprobs`` at each vocabulary: log-probs from bf16 hidden states and the output
  weight (both trained) without the logits, at two caps of the block (``train.logps_chunk_tokens``; the rows a
  block uses, ``hl_core.logprobs.hidden.block_rows``, are reported beside them), against the
  logits then a plain float32 ``log_softmax``: peak memory beyond the hidden states, the weight and their
  gradients (goal: 0.05x or less), max |difference| of values and hidden-state gradients; and the reference's
  no-grad forward (the copy, the look-ahead store and the cache run it, on the policy's trainable weight) at the
  default block, beyond the hidden states and the weight (goal: 0.05x or less).
- ``train``: Llama-3.2-1B and Qwen2.5-1.5B shapes at 2 layers, humanline DPO (and humanline GRPO) through
  DeepSpeed ZeRO-0 fp32 / bf16, ZeRO-3 bf16 on 2 processes, megatron tp=2 and pp=2 (fp32): per component
  (at rest, gradients, activations, logits, peak) the measured GiB per process, the plan's, and the ratio.
- ``forward``: the shapes too large to train here with Adam (Llama-3-8B, Gemma-2-27B at 1 layer):
  activations and logits of a policy forward + backward, against the plan.

Memory is each process's resident set above what it held before the model was built, with glibc
returning large blocks at once (``bench/memprobe.py``); one process per measurement. Components:
at rest = after an update (weights, optimizer states, reference); gradients = held after the backward
minus before the forward; activations = held after the policy forward minus the logits tensor; logits =
the logits tensor plus the log-prob backward's own peak (measured by the ``logprobs`` section at the same
vocabulary); peak = the largest inside any engine call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import realistic_shapes_runs as runs  # noqa: E402
from bench.memprobe import CPU_ALLOCATOR_ENV, GIB  # noqa: E402
from bench.shapes import spec_of, write_model_dir, write_rows  # noqa: E402
from hl_core import children  # noqa: E402 (the runs end with this script)
from hl_core.logprobs.hidden import block_rows  # noqa: E402

VOCABS = {"llama3 (128k)": 128256, "qwen2.5 (152k)": 151936, "gemma2 (256k)": 256000}
LOGPROB_BATCH = dict(rows=2, steps=1024, chunk=128)  # two sequences of the GPU check's length; 2 x 128 positions
# = the default `train.logps_chunk_tokens` (256) per float32 block
HIDDEN_BATCH = dict(rows=1, steps=1024, width=2048)  # one sequence of the GPU check's length at Llama-3.2-1B's width
# (a plain log_softmax over two would pass 6 GiB at 256k); blocks: the default `train.logps_chunk_tokens`, and 64
HIDDEN_BLOCKS = (256, 16)
TRAIN_SHAPES = ("llama3.2-1b", "qwen2.5-1.5b")
FORWARD_SHAPES = (("llama3-8b", "sdpa"), ("gemma2-27b", "eager"))
SEQ, PROMPT = 160, 16
MEGATRON = ["engine.name=megatron", "engine.zero_stage=0", "engine.precision=fp32"]
LAYOUTS = (  # (label, processes, data-parallel size, overrides)
    ("DeepSpeed ZeRO-0 fp32", 1, 1, ["engine.zero_stage=0", "engine.precision=fp32"]),
    ("DeepSpeed ZeRO-0 bf16", 1, 1, ["engine.zero_stage=0", "engine.precision=bf16"]),
    ("DeepSpeed ZeRO-3 bf16 x2", 2, 2, ["engine.zero_stage=3", "engine.precision=bf16"]),
    ("megatron tp=2 fp32", 2, 1, [*MEGATRON, "parallel.tp=2"]),
    ("megatron pp=2 fp32", 2, 1, [*MEGATRON, "parallel.pp=2"]),
)


def launch(kind: str, args: dict, out: Path, nproc: int = 1, timeout: float = 900) -> list:
    """Run one measurement in fresh process(es); return the per-rank results."""
    worker = json.dumps({"kind": kind, "args": args, "out": str(out)})
    script = [str(Path(__file__).resolve()), "--worker", worker]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
               *script]
    env = dict(os.environ, **CPU_ALLOCATOR_ENV, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    proc = children.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} {args} failed ({proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


# ------------------------------------------------------------------------------------------ sections
def section_logprobs(work: Path) -> list:
    import torch

    results = []
    for label, vocab in VOCABS.items():
        row = {"section": "logprobs", "vocab": label}
        for impl in ("ours", "naive"):
            out = work / f"lp_{vocab}_{impl}"
            row[impl] = launch("logprobs", dict(vocab=vocab, impl=impl, **LOGPROB_BATCH), out)[0]
        ours, naive = (torch.load(work / f"lp_{vocab}_{impl}.{impl}.pt", weights_only=True) for impl
                       in ("ours", "naive"))
        n = row["ours"]["logits"]
        row.update(logits=n, ours_gib=row["ours"]["peak_bytes"] / GIB, naive_gib=row["naive"]["peak_bytes"] / GIB,
                   ours_bytes_per_logit=row["ours"]["peak_bytes"] / n, naive_bytes_per_logit=row["naive"]["peak_bytes"]
                   / n,
                   ratio=row["ours"]["peak_bytes"] / row["naive"]["peak_bytes"],
                   max_abs_diff=(ours["values"] - naive["values"]).abs().max().item(),
                   max_abs_grad_diff=(ours["grad"] - naive["grad"]).abs().max().item())
        del row["ours"], row["naive"]
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def section_hidden(work: Path) -> list:
    """Per vocabulary: the policy's forward + backward at each block size, and the reference's no-grad forward at
    the default block, each against the logits path of the same kind."""
    import torch

    results = []
    for label, vocab in VOCABS.items():
        for forward, blocks in (("policy", HIDDEN_BLOCKS), ("reference", HIDDEN_BLOCKS[:1])):
            runs = {}
            for impl, block in [("plain", 0)] + [("fused", b) for b in blocks]:
                out = work / f"hid_{vocab}_{forward}_{impl}{block}"
                runs[(impl, block)] = launch("hidden_logprobs",
                                             dict(vocab=vocab, impl=impl, block=block, forward=forward,
                                                                     **HIDDEN_BATCH), out)[0]
                runs[(impl, block)]["saved"] = torch.load(out.with_suffix(f".{impl}{block}.pt"), weights_only=True)
            plain = runs[("plain", 0)]
            for block in blocks:
                fused = runs[("fused", block)]
                row = {"section": "hidden", "forward": forward, "vocab": label, "block_tokens": block,
                       "block_rows": block_rows(HIDDEN_BATCH["rows"] * HIDDEN_BATCH["steps"], vocab, block),
                       "tokens": HIDDEN_BATCH["rows"] * HIDDEN_BATCH["steps"], "width": HIDDEN_BATCH["width"],
                       "fused_gib": fused["peak_bytes"] / GIB, "plain_gib": plain["peak_bytes"] / GIB,
                       "ratio": fused["peak_bytes"] / plain["peak_bytes"],
                       "max_abs_diff": (fused["saved"]["values"] - plain["saved"]["values"]).abs().max().item()}
                if forward == "policy":
                    row["max_abs_grad_diff"] = (fused["saved"]["grad"] - plain["saved"]["grad"]).abs().max().item()
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def section_train(work: Path) -> list:
    results = []
    for shape in TRAIN_SHAPES:
        spec = spec_of(shape, num_layers=2)
        model = write_model_dir(spec, work / f"model_{shape}")
        data = work / f"pairs_{shape}.jsonl"
        write_rows(data, "pairs", 16, SEQ - PROMPT - 16, PROMPT)
        common = [f"model.name_or_path={model}", "model.random_init=true", "model.attn_implementation=sdpa",
                  f"data.train.path={data}", "data.eval=null", f"data.max_length={SEQ}",
                  f"data.max_prompt_length={PROMPT + 8}",
                  "train.micro_batch_size=1", "train.max_steps=4", "train.lr=1e-5", "train.warmup_steps=0",
                  "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false",
                  "logging.progress_bar=false"]
        cases = [(*layout, "recipes/tiny/humanline_dpo.yaml") for layout in LAYOUTS]
        if shape == TRAIN_SHAPES[0]:  # GRPO's micro-batch differs from DPO's only in its rows: one shape is enough
            cases.append(("DeepSpeed ZeRO-0 bf16", 1, 1, LAYOUTS[1][3], "recipes/tiny/humanline_grpo.yaml"))
        for label, nproc, dp, extra, recipe in cases:
            out = work / f"train_{shape}_{len(results)}"
            started = time.perf_counter()
            overrides = [*common, *extra, f"output_dir={out}/run", f"train.global_batch_size={dp}"]
            ranks = launch("train", dict(recipe_path=str(REPO / recipe), overrides=overrides), out, nproc=nproc)
            row = compare(shape, label, recipe, ranks)
            row["wall_s"] = round(time.perf_counter() - started, 1)
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def compare(shape: str, label: str, recipe: str, ranks: list) -> dict:
    """Measured components of the most loaded rank beside the plan's, as GiB and measured/plan ratios.

    The CPU adds one thing the plan (written for GPUs) leaves out: torch's AdamW steps CPU tensors one at a
    time and makes two float32 temporaries the size of the tensor it steps (the largest parameter, or
    DeepSpeed's flat float32 partition), which the fused GPU kernel does not; the peak's plan figure here
    adds them (``cpu_step_temporaries``), except for megatron, whose CPU-path plan counts its own step
    (``hl_core.preflight.plan_terms.megatron_cpu_step_bytes``)."""
    r = max(ranks, key=lambda x: max(p["peak"] for p in x["phases"].values()))
    ph, plan = r["phases"], r["plan_gib"]
    precision_bytes = 4 if "fp32" in label else 2
    logits_tensor = r["plan_sequences"] * r["seq_len"] * r["vocab"] / r["tp"] * precision_bytes / GIB
    cpu_step = 0.0 if label.startswith("megatron") else 2 * 4 * r["largest_stepped_tensor"] / GIB
    measured = {"at rest": r["rest_gib"], "logits": logits_tensor + r["logprobs_peak_gib"],
                "peak": max(p["peak"] for p in ph.values())}
    predicted = {"at rest": plan["resident"], "logits": plan["logits"], "peak": plan["total"] + cpu_step}
    policy = ph["token_logps:policy"]
    measured["gradients"] = ph["backward"]["after"] - policy["before"]
    predicted["gradients"] = plan["backward_gradients"]
    # pp runs its policy forward forward-only (recomputed in the backward), and ZeRO-3 keeps parameters
    # gathered through the forward: for those the forward's growth is not the activations
    if "pp=2" not in label and "ZeRO-3" not in label:
        measured["activations"] = policy["after"] - policy["before"] - logits_tensor
        predicted["activations"] = plan["activations_full"]
    ratios = {k: measured[k] / predicted[k] if predicted[k] else None for k in measured}
    return {"section": "train", "shape": shape, "layout": label, "objective": Path(recipe).stem, "ranks": len(ranks),
            "measured_gib": measured, "plan_gib": predicted, "ratio": ratios, "cpu_step_temporaries_gib": cpu_step,
            "phases": ph}


def section_forward(work: Path) -> list:
    from hl_core.config import load_recipe, run_shape
    from hl_core.models.specs import resolve_spec
    from hl_core.preflight.plan import memory_plan

    results, rows, steps = [], 2, 256
    for shape, attn in FORWARD_SHAPES:
        model = write_model_dir(spec_of(shape, num_layers=1), work / f"fwd_{shape}")
        out = work / f"forward_{shape}"
        r = launch("forward", dict(model_dir=str(model), attn=attn, precision="bf16", rows=rows, steps=steps), out)[0]
        recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [
            f"model.name_or_path={model}", f"model.attn_implementation={attn}", "engine.precision=bf16",
            f"data.max_length={steps}", f"train.micro_batch_size={rows // 2}", "output_dir=/tmp/unused"])
        plan = memory_plan(run_shape(recipe), world_size=1, spec=resolve_spec(recipe.model))["gib"]
        logits_tensor = rows * steps * r["vocab"] * 2 / GIB
        kept_logits = logits_tensor * (2 if shape.startswith("gemma2") else 1)  # + the soft-capping's tanh
        measured = {"activations": r["kept_gib"] - kept_logits, "logits": kept_logits + r["logprobs_peak_gib"]}
        predicted = {"activations": plan["activations_full"], "logits": plan["logits"]}
        row = {"section": "forward", "shape": shape, "layout": f"1 layer, bf16, {attn} attention, forward + backward",
               "measured_gib": measured, "plan_gib": predicted,
               "ratio": {k: measured[k] / predicted[k] for k in measured}}
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def markdown(results: list) -> str:
    lines = []  # a table per section that ran
    if any(x["section"] == "logprobs" for x in results):
        lines += ["| vocabulary | logits | ours GiB (bytes/logit) | plain log_softmax GiB (bytes/logit) | ratio | max "
                  "abs diff (values, grads) |", "|---|---:|---:|---:|---:|---:|"]
    for r in (x for x in results if x["section"] == "logprobs"):
        lines.append(f"| {r['vocab']} | {r['logits']:,} | {r['ours_gib']:.2f} ({r['ours_bytes_per_logit']:.2f}) | "
                     f"{r['naive_gib']:.2f} ({r['naive_bytes_per_logit']:.2f}) | {r['ratio']:.3f} | "
                     f"{r['max_abs_diff']:.1e}, {r['max_abs_grad_diff']:.1e} |")
    hidden = [x for x in results if x["section"] == "hidden"]
    if hidden:
        lines += ["",
                  "| vocabulary | forward | `train.logps_chunk_tokens` (tokens per block at most: used) | fused GiB | "
                  "logits + plain log_softmax GiB | ratio (goal <= 0.05) | max abs diff (values, grads) |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r in hidden:
            kind = ("policy (forward + backward)" if r.get("forward", "policy") == "policy"
                    else "reference (no-grad forward)")
            grads = f", {r['max_abs_grad_diff']:.1e}" if "max_abs_grad_diff" in r else ""
            used = f": {r['block_rows']}" if "block_rows" in r else ""
            lines.append(f"| {r['vocab']} | {kind} | {r['block_tokens']}{used} | {r['fused_gib']:.3f} | "
                         f"{r['plain_gib']:.2f} | {r['ratio']:.3f} | {r['max_abs_diff']:.1e}{grads} |")
    keys = ("at rest", "gradients", "activations", "logits", "peak")
    if not any(x["section"] in ("train", "forward") for x in results):
        return "\n".join(lines).strip("\n") + "\n"
    lines += ["", "| shape | layout / objective | " + " | ".join(f"{k}: measured / plan GiB (ratio)" for k in keys)
              + " |",
              "|---|---|" + "---:|" * len(keys)]
    for r in (x for x in results if x["section"] in ("train", "forward")):
        cells = []
        for k in keys:
            m, p, q = r["measured_gib"].get(k), r["plan_gib"].get(k), r["ratio"].get(k)
            cells.append("-" if m is None else f"{m:.2f} / {p:.2f} ({q:.2f})" if q is not None
                         else f"{m:.2f} / {p:.2f}")
        lines.append(f"| {r['shape']} | {r['layout']}{', ' + r['objective'] if 'objective' in r else ''} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", nargs="*", default=["logprobs", "hidden", "train", "forward"],
                        choices=["logprobs", "hidden", "train", "forward"])
    parser.add_argument("--out", default="runs/realistic_shapes/results.jsonl")
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--hidden-width", type=int, default=HIDDEN_BATCH["width"],
                        help="the hidden section's width (the measured terms are tokens x vocabulary; 32 keeps a run "
                             "to seconds on a 2-core machine where bf16 products at 2048 take minutes)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        job = json.loads(args.worker)
        getattr(runs, job["kind"])(**job["args"], out=Path(job["out"]))
        return 0
    HIDDEN_BATCH["width"] = args.hidden_width
    started, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="realistic_shapes_") as tmp:
        work = Path(tmp)
        if "logprobs" in args.sections:
            results += section_logprobs(work)
        if "hidden" in args.sections:
            results += section_hidden(work)
        if "train" in args.sections:
            results += section_train(work)
        if "forward" in args.sections:
            results += section_forward(work)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in results))
    table = markdown(results)
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table + f"\n{len(results)} results in {out} ({time.perf_counter() - started:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
