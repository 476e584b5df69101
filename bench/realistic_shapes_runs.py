"""What ``bench/realistic_shapes.py`` runs in each measured process (one process per measurement, or two
under torchrun; every rank writes ``<out>/rank<r>.json``). Memory is the process's resident set
(``bench.memprobe.RssProbe``) with glibc returning large blocks at once (``CPU_ALLOCATOR_ENV``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bench.memprobe import GIB, RssProbe, phase_memory

BYTES = {"fp32": 4, "bf16": 2}


def _write(out: Path, rank: int, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))


# --------------------------------------------------------------------------------------- log-probs
def logprobs(vocab: int, rows: int, steps: int, chunk: int, impl: str, out: Path) -> None:
    """Forward + backward of token log-probs over bf16 logits ``[rows, steps, vocab]``: peak bytes held
    beyond the logits themselves, and the values and gradients (written for the parent to compare)."""
    import torch

    from hl_core.logprobs import token_logps

    torch.manual_seed(0)
    probe = RssProbe()
    logits = (torch.randn(rows, steps, vocab) * 2).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows, steps))
    weights = torch.randn(rows, steps)
    base = probe.current()
    probe.reset_peak()
    if impl == "ours":
        values = token_logps(logits, labels, chunk_size=chunk)
    else:  # the plain way: one float32 log-softmax over the whole [B, T, V]
        values = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    (values * weights).sum().backward()
    peak = probe.peak() - base
    torch.save({"values": values.detach(), "grad": logits.grad.float()[:, :8]}, out.with_suffix(f".{impl}.pt"))
    _write(out, 0, {"impl": impl, "vocab": vocab, "logits": rows * steps * vocab, "peak_bytes": peak})


def hidden_logprobs(vocab: int, width: int, rows: int, steps: int, block: int, impl: str, out: Path,
                    forward: str = "policy") -> None:
    """Token log-probs from bf16 hidden states ``[rows, steps, width]`` and a bf16 output weight ``[vocab, width]``
    (both trainable). ``forward``: ``policy`` (forward + backward; peak bytes held beyond the hidden states, the
    weight and the two gradients every method returns) or ``reference`` (a no-grad forward, as the reference's
    copy, the look-ahead store and the cache run it on the policy's weight: peak bytes beyond the hidden states and
    the weight). ``impl``: ``fused`` (``train.fused_logprobs``, ``block`` tokens per block) or ``plain`` (the
    logits, then one float32 log_softmax over ``[B, T, V]``)."""
    import torch

    from hl_core.logprobs.hidden import hidden_token_logps

    torch.manual_seed(0)
    probe = RssProbe()
    hidden = torch.randn(rows, steps, width).to(torch.bfloat16).requires_grad_(True)
    weight = (torch.randn(vocab, width) / width ** 0.5).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows, steps))
    weights = torch.randn(rows, steps)
    base = probe.current()
    probe.reset_peak()
    with torch.set_grad_enabled(forward == "policy"):
        if impl == "fused":
            values = hidden_token_logps(hidden, weight, labels, block_tokens=block)
        else:
            values = (hidden @ weight.t()).float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    if forward == "policy":
        (values * weights).sum().backward()
    returned = (hidden.numel() + weight.numel()) * 2 if forward == "policy" else 0  # the two bf16 gradients
    peak = probe.peak() - base - returned
    saved = {"values": values.detach()}
    if forward == "policy":
        saved["grad"] = hidden.grad.float()[:, :8]
    torch.save(saved, out.with_suffix(f".{impl}{block}.pt"))
    _write(out, 0, {"impl": impl, "vocab": vocab, "block": block, "logits": rows * steps * vocab, "peak_bytes": peak,
                    "forward": forward})


# --------------------------------------------------------------------------------------- training
def train(recipe_path: str, overrides: list, out: Path) -> None:
    """One update of the recipe through our trainer and engine (it allocates the optimizer states), then one
    instrumented update. Writes per-rank memory at rest, per engine call, and the plan."""
    import torch

    from hl_core.config import load_recipe, run_shape
    from hl_core.models.specs import resolve_spec
    from hl_core.preflight.plan import memory_plan
    from hl_core.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // int(os.environ.get("WORLD_SIZE", "1"))))
    recipe = load_recipe(recipe_path, overrides)
    probe = RssProbe()
    trainer = Trainer(recipe)
    base = probe.current()  # interpreter, torch, deepspeed and megatron modules: before any model exists
    trainer.setup()
    setup = probe.current() - base
    rows = [trainer.train_step()]
    rest = probe.current() - base
    phases = phase_memory(trainer, probe, base)
    engine = trainer.engine
    spec = resolve_spec(recipe.model)
    # the megatron engine's CPU path: a torch optimizer replicated over data parallel, gradients in .grad
    plan = memory_plan(run_shape(recipe), world_size=engine.world_size, spec=spec, distributed_optimizer=False,
                       megatron_gpu=False)
    batch = trainer.source.batches(0)[0] if hasattr(trainer.source, "dataset") else None
    seq_len = int(batch["input_ids"].shape[1]) if batch is not None else recipe.data.max_length
    tp = engine.__dict__.get("tp", 1)
    # the largest tensor the torch optimizer steps (DeepSpeed wraps it and may step flat partitions):
    # its Adam moments have that tensor's shape
    inner = engine.optimizer
    while not isinstance(inner, torch.optim.Optimizer) and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    optimized = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
    result = dict(rank=engine.rank, setup_gib=setup / GIB, rest_gib=rest / GIB, phases=phases, plan_gib=plan["gib"],
                  plan_sequences=plan["sequences_per_micro_batch"], seq_len=seq_len, vocab=spec.vocab_size, tp=tp,
                  params=spec.num_params(), losses=[r["loss"] for r in rows],
                  largest_stepped_tensor=max(p.numel() for p in optimized) if optimized else 0)
    trainer.close()
    # the log-probs alone at this run's shape: logits of one micro-batch in the compute dtype, forward + backward
    result["logprobs_peak_gib"] = _logprobs_peak(plan["sequences_per_micro_batch"], seq_len, spec.vocab_size // tp,
                                                 recipe.engine.precision, recipe.train.logps_chunk_tokens, probe)
    _write(out, result["rank"], result)


def _logprobs_peak(rows: int, steps: int, vocab: int, precision: str, chunk_tokens: int, probe) -> float:
    """GiB held beyond the logits while our token log-probs run forward and backward over them."""
    import torch

    from hl_core.logprobs import chunk_positions, token_logps

    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    logits = torch.randn(rows, steps, vocab, dtype=dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (rows, steps))
    base = probe.current()
    probe.reset_peak()
    token_logps(logits, labels, chunk_size=chunk_positions(rows, chunk_tokens)).sum().backward()
    return (probe.peak() - base) / GIB


# --------------------------------------------------------------------------------------- forward only
def forward(model_dir: str, attn: str, precision: str, rows: int, steps: int, out: Path) -> None:
    """The shapes too large to train here with Adam: the policy's forward + backward through our log-probs
    (no optimizer, no reference). Activations kept by the forward, and the backward's peak."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hl_core.logprobs import sequence_token_logps

    torch.set_num_threads(os.cpu_count() or 2)
    probe = RssProbe()
    base = probe.current()
    config = AutoConfig.from_pretrained(model_dir)
    # initialised in the compute dtype directly: a float32 copy of Gemma-2-27B's 256k x 4608 embedding
    # alone would take 4.4 GiB more
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn,
                                             dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[precision])
    model.config.use_cache = False
    weights = probe.current() - base
    ids = torch.randint(3, 400, (rows, steps))
    before = probe.current()
    probe.reset_peak()
    logps = sequence_token_logps(model, ids, torch.ones_like(ids))
    kept = probe.current() - before
    forward_peak = probe.peak() - before
    probe.reset_peak()
    logps.sum().backward()
    backward_peak = probe.peak() - before
    del logps, model
    lp_peak = _logprobs_peak(rows, steps, config.vocab_size, precision, 256, probe)
    _write(out, 0, dict(weights_gib=weights / GIB, kept_gib=kept / GIB, forward_peak_gib=forward_peak / GIB,
                        backward_peak_gib=backward_peak / GIB, logprobs_peak_gib=lp_peak, rows=rows, steps=steps,
                        vocab=config.vocab_size, bytes=BYTES[precision]))
