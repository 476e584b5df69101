"""Token log-probs from the hidden states, alone: our blockwise path, Liger's fused linear cross-entropy and the plain
logits path, side by side on one device, at a GPU-check micro-batch's shape.

    python bench/fused_logps.py                      # on a GPU: 8,192 tokens, width 2,048, 128k vocabulary, bf16
    python bench/fused_logps.py --tokens 256 --width 64 --vocab 4096 --repeats 2   # a quick CPU run

For each implementation, the milliseconds of one call (best of ``--repeats`` after a warm-up) and the peak memory
above the inputs: the reference's no-grad forward, and the policy's forward + backward (hidden states and output
weight both trained). The implementations:

* ``plain``: ``(hidden @ W.T).float().log_softmax(-1).gather(labels)``, the ``[N, V]`` logits held.
* ``blockwise``: ``hidden_token_logps(..., backend="torch")``, in `block_rows` rows
  per block (printed).
* ``liger``: ``hidden_token_logps(..., backend="liger")`` for the forward + backward (Liger-Kernel's fused linear
  cross-entropy; CUDA and liger-kernel only). A no-grad forward never uses it, so its no-grad row is ``blockwise``'s.

Prints one table and the ratios against ``plain``, and the largest difference of values and hidden-state gradients
against ``plain``. It isolates what ``train.fused_logprobs`` costs within an update (``bench/gpu_check.py`` sections 5
and 8 measure whole updates). Speed claims come from its output only. Memory on the CPU is not measured (``-``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build_inputs(args, device, dtype):
    import torch

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.width, generator=gen).to(device, dtype)
    weight = (torch.randn(args.vocab, args.width, generator=gen) / args.width ** 0.5).to(device, dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    upstream = torch.randn(args.tokens, generator=gen).to(device)
    return hidden, weight, labels, upstream


def implementations(cuda: bool):
    """``{name: fn(hidden, weight, labels) -> float32 log-probs}``; liger only where it can run."""
    from hl_core.config.checks import installed
    from hl_core.logprobs.hidden import hidden_token_logps

    def plain(hidden, weight, labels):
        return (hidden @ weight.t()).float().log_softmax(-1).gather(-1, labels[:, None])[:, 0]

    impls = {"plain": plain,
             "blockwise": lambda h, w, y: hidden_token_logps(h, w, y, backend="torch")}
    if cuda and installed("liger_kernel"):
        impls["liger"] = lambda h, w, y: hidden_token_logps(h, w, y, backend="liger")
    return impls


def measure(fn, inputs, backward: bool, repeats: int, device) -> dict:
    """The best time of ``repeats`` calls after one warm-up, the peak memory above the inputs (CUDA), and the last
    call's values (and hidden-state gradient)."""
    import torch

    hidden, weight, labels, upstream = inputs
    cuda = device.type == "cuda"
    best, peak, out = float("inf"), None, {}
    for attempt in range(repeats + 1):
        h = hidden.detach().requires_grad_(backward)
        w = weight.detach().requires_grad_(backward)
        if cuda:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with torch.set_grad_enabled(backward):
            values = fn(h, w, labels)
            if backward:
                (values * upstream).sum().backward()
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        if attempt:  # the first call warms up (kernels, autotuning, allocator)
            best = min(best, seconds)
            if cuda:
                returned = (h.numel() + w.numel()) * h.element_size() if backward else 0
                peak = max(peak or 0, torch.cuda.max_memory_allocated(device) - base - returned)
        out = {"values": values.detach().float(), "grad": h.grad.float() if backward else None}
    return {"ms": best * 1e3, "peak_gib": None if peak is None else peak / 2 ** 30, **out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="valid tokens of one micro-batch (N)")
    parser.add_argument("--width", type=int, default=2048, help="hidden size (H)")
    parser.add_argument("--vocab", type=int, default=128256, help="vocabulary (V)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-tokens", type=int, default=256, help="train.logps_chunk_tokens")
    args = parser.parse_args(argv)
    import torch

    from hl_core.logprobs.hidden import block_rows

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    inputs = build_inputs(args, device, dtype)
    impls = implementations(cuda)
    rows = block_rows(args.tokens, args.vocab, args.block_tokens)
    results = {}
    for name, fn in impls.items():
        for kind, backward in (("reference (no-grad forward)", False), ("policy (forward + backward)", True)):
            if name == "liger" and not backward:
                continue  # a no-grad forward is blockwise's
            results[(name, kind)] = measure(fn, inputs, backward, args.repeats, device)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"device: {name}; N={args.tokens} tokens, H={args.width}, V={args.vocab}, {args.dtype}; blockwise: {rows} "
          f"rows per block, {-(-args.tokens // rows)} blocks; best of {args.repeats} after a warm-up")
    print(f"{'implementation':10} {'call':30} {'ms':>9} {'peak GiB':>9} {'vs plain':>9} {'max |dv|':>9} "
          f"{'max |dg|':>9}")
    for (impl, kind), r in results.items():
        ref = results[("plain", kind)]
        dv = (r["values"] - ref["values"]).abs().max().item()
        dg = "-" if r["grad"] is None else f"{(r['grad'] - ref['grad']).abs().max().item():.1e}"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.3f}"
        print(f"{impl:10} {kind:30} {r['ms']:>9.2f} {peak:>9} {ref['ms'] / r['ms']:>8.2f}x {dv:>9.1e} {dg:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
