"""Shape-only kernels: the matrix products and fused attention of a rehearsal return zero tensors of the
shapes, dtypes and strides the real kernels would (their meta implementations say which), without the
arithmetic.

Why: on a CPU without bfloat16 instructions (AVX2 only) a bfloat16 matrix product runs at a few GFLOP/s
(3.4 measured on this project's 2-core build machine against 36 in float32), so one update of a Gemma-2-27B
layer at 2048 tokens would take hours. Memory does not depend on the values: every tensor the engine
allocates is allocated as before (the zeros are real tensors, made by an ordinary operation the memory
ledger sees), and every other operation (norms, softmax, the log-probs, the optimizer, the collectives) runs
for real. What it costs: the values are meaningless (as they already are under the fake process group:
zeros keep them finite) and the compute time is not the model's; the report says so. On a GPU the real
kernels run (``kernels=real``), and the tests compare both at tiny shapes.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

aten = torch.ops.aten


def _ops(*names):
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(aten, packet, None)
        if op is not None and hasattr(op, overload or "default"):
            found.add(getattr(op, overload or "default"))
    return frozenset(found)


# the products (linear layers, attention scores and values, their gradients) and the fused attention kernels
HEAVY_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
)


class ShapeOnlyKernels(TorchDispatchMode):
    """Inside this mode the ``HEAVY_OPS`` return zeros shaped like their real outputs."""

    def __init__(self):
        super().__init__()
        self.skipped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in HEAVY_OPS:
            return func(*args, **kwargs)
        device = next(t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        shaped = func(*meta_args, **meta_kwargs)
        self.skipped += 1
        return tree_map_only(
            torch.Tensor, lambda m: torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_(),
            shaped
        )
