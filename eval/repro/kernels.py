"""Which CPU kernels a study's runs round with: a fingerprint, so that a curve is compared only with curves that
the same kernels computed.

The runs pin their kernels (``eval.repro.runs.CPU_KERNELS``: ATen's AVX2 code, MKL's AVX2 branch, oneDNN's AVX2
cap), but MKL honours its branch only on Intel CPUs: elsewhere ``MKL_CBWR=AVX2`` silently falls back to the CPU's
own branch (Intel's oneMKL developer guide, "Getting Started with Conditional Numerical Reproducibility"). A warm-up
of a few hundred updates amplifies one rounding difference into another model (measured: the quick grid's pinned
curve moved between two machines with the same code and packages). So every result records, beside the settings,
what they produce: ``fingerprint()`` runs a few fixed computations of each kind the runs use and hashes their
bytes, per kind:

* ``blas``: matrix products through MKL (``mm``, ``bmm``, ``addmm``, transposed and offset operands);
* ``vector_math``: ATen's vectorised elementwise kernels (exp, log, tanh, sigmoid, SiLU, rsqrt, pow, cos, sin,
  softmax, log-softmax);
* ``reductions``: sums, means, norms and cross-entropy over long rows;
* ``random``: the generators the runs draw from (normal, uniform, multinomial, permutation);
* ``optimizer``: AdamW steps (torch's, as DeepSpeed's engine uses it on the CPU).

``cpu`` (vendor and model, from /proc/cpuinfo) is recorded beside them but not compared: two CPUs that compute the
same bytes are interchangeable. Run it in the study's child environment (``python -m eval.repro.kernels`` under
``runs.child_env()``, or as a worker task): the kernel switches are read when torch starts.
"""

from __future__ import annotations

import hashlib
import json
import platform
from typing import Dict

KINDS = ("blas", "vector_math", "reductions", "random", "optimizer")


def _digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def cpu_model() -> str:
    """The CPU's vendor and model name (Linux: /proc/cpuinfo), else what ``platform`` knows."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return " ".join(v for v in (fields.get("vendor_id"), fields.get("model name")) if v) or platform.processor()


def fingerprint() -> Dict[str, str]:
    """One hash per kind of kernel (``KINDS``), and the CPU model. Deterministic for given kernels."""
    import torch

    g = torch.Generator().manual_seed(1234)
    a = torch.randn(67, 131, generator=g)
    b = torch.randn(131, 45, generator=g)
    c = torch.randn(5, 33, 70, generator=g)
    blas = _digest(a @ b, a[1:, 3:] @ b[3:, 1:], b.t() @ a.t(), torch.bmm(c, c.transpose(1, 2)),
                   torch.addmm(a[:45, :45], a[:45, 45:90], b[:45, :45]))

    x = torch.randn(4099, generator=g) * 4
    vector_math = _digest(x.exp(), x.abs().add(1e-3).log(), x.tanh(), x.sigmoid(), torch.nn.functional.silu(x),
                          x.abs().add(1e-3).rsqrt(), x.abs().pow(0.37), x.cos(), x.sin(),
                          x.view(1, -1).softmax(-1), x.view(1, -1).log_softmax(-1))

    rows = torch.randn(37, 5003, generator=g)
    labels = torch.randint(0, 5003, (37,), generator=g)
    reductions = _digest(rows.sum(-1), rows.mean(0), rows.norm(dim=-1), rows.logsumexp(-1),
                         torch.nn.functional.cross_entropy(rows, labels).view(1))

    torch.manual_seed(99)
    probs = torch.rand(16, 97).softmax(-1)
    random = _digest(torch.randn(1001), torch.rand(1001), torch.empty(257).normal_(0, 0.02),
                     torch.multinomial(probs, 3).double(), torch.randperm(1000).double())

    weights = torch.nn.Parameter(torch.randn(129, 65, generator=g))
    opt = torch.optim.AdamW([weights], lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        opt.zero_grad()
        (weights.square().sum() + weights.sin().sum()).backward()
        opt.step()
    optimizer = _digest(weights)
    return dict(blas=blas, vector_math=vector_math, reductions=reductions, random=random, optimizer=optimizer,
                cpu=cpu_model())


def differing(a: Dict[str, str], b: Dict[str, str]) -> list:
    """The kinds of kernel (``KINDS``) whose hashes differ between two fingerprints (a missing one differs)."""
    return [k for k in KINDS if (a or {}).get(k) is None or (a or {}).get(k) != (b or {}).get(k)]


def describe(fp: Dict[str, str]) -> str:
    """One phrase for a report: the CPU and one hash over every kind (curves compare to the bit only where it is
    the same)."""
    if not fp:
        return "kernel fingerprint not recorded"
    combined = hashlib.sha256(" ".join(str(fp.get(k)) for k in KINDS).encode()).hexdigest()[:12]
    return f"CPU {fp.get('cpu') or 'unknown'}, kernel fingerprint {combined}"


if __name__ == "__main__":
    print(json.dumps(fingerprint()))
