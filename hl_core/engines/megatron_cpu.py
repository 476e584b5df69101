"""The CPU shim for megatron-core: every patch that lets Megatron run without a GPU, in one place.

Megatron-core (0.16 checked) assumes CUDA in a few spots that the CPU tests (gloo, no GPU) reach:

1. ``torch.cuda.current_device()``: used as ``device=`` when allocating parameters and buffers
   (``ColumnParallelLinear``, ``VocabParallelEmbedding``, the rotary embedding, the global memory
   buffer) and by the pipeline p2p shape exchange. Patched to return ``"cpu"``.
2. ``torch.cuda.synchronize()``: called after the p2p shape exchange in
   ``pipeline_parallel/p2p_communication.py``. Patched to a no-op.
3. ``CudaRNGStatesTracker.add`` / ``.fork``: the tensor-parallel RNG tracker stores and swaps CUDA
   generator states. Patched to store CPU generator states and swap the CPU default generator, so
   dropout inside tensor-parallel regions still draws from a per-TP-rank stream.
4. ``Tensor.cuda()`` / ``Module.cuda()``: ``LanguageModule.setup_embeddings_and_output_layer``
   moves the tied output-layer copy with ``weight.data.cuda()`` (pp > 1, tied embeddings). Patched
   to return the tensor / module unchanged.
5. ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: activation recompute
   (``recompute_granularity: full``, our ``model.gradient_checkpointing``) saves and restores the CUDA
   generator next to the CPU one and the tracker's. Patched to an empty state / a no-op.
6. ``torch.zeros(..., device="cuda")``: the token counters in ``pipeline_parallel/schedules.py``.
   The ``schedules`` module's global ``torch`` is replaced by a proxy whose ``zeros`` maps a CUDA
   device to the CPU; every other attribute is torch's own.

Fusions must be off in the model config (``masked_softmax_fusion``, ``bias_dropout_fusion``,
``apply_rope_fusion``, ``gradient_accumulation_fusion``, ``bias_activation_fusion``), attention needs
an explicit boolean causal mask, and sequence parallel stays off (it needs TE/Apex norms); the engine
does all of that. Megatron's own optimizer checks tensor types for "cuda", so on CPU the engine uses
a torch optimizer over the local shards instead (see ``megatron_engine``).

Every patch is a swap (``hl_core.swaps``): ``shims()`` puts them in place and returns a ``CpuShims`` handle whose
``undo()`` (or the end of a ``with`` block) takes out exactly those layers, in stack order, so a block's shims never
outlive it and never remove another holder's. ``install()`` is the engine's: the shims for the rest of the process,
once. Both refuse to run when CUDA is available: on a GPU nothing here is ever installed.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional

import torch

from ..swaps import Swap, swap

# Imports inside functions: megatron-core is an optional extra; the shims load it when they are installed.

_PROCESS_SHIMS: Optional["CpuShims"] = None  # install()'s, kept for the process


def needed() -> bool:
    """The shim is for machines without a GPU only."""
    return not torch.cuda.is_available()


class CpuShims:
    """The CPU shims one ``shims()`` call put in place: ``undo()`` (idempotent) or the end of a ``with`` block takes
    these layers out again, newest first; shims put in place by another call stay.

    Attributes:
        layers: the ``hl_core.swaps.Swap`` handles, in the order they were made.
    """

    def __init__(self, layers: List[Swap]):
        self.layers = layers

    @property
    def active(self) -> bool:
        """Whether these shims are still in place."""
        return any(layer.active for layer in self.layers)

    def undo(self) -> None:
        for layer in reversed(self.layers):
            layer.undo()

    def __enter__(self) -> "CpuShims":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


class _TorchProxy:
    """``torch`` for one Megatron module, except that ``zeros(device="cuda")`` allocates on the CPU."""

    def __init__(self, module):
        self._torch = module

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def zeros(self, *args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return self._torch.zeros(*args, **kwargs)


def _cpu_add(self, name, seed):
    """``CudaRNGStatesTracker.add`` on CPU: a CPU generator state seeded with ``seed``."""
    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    self.states_[name] = torch.Generator().manual_seed(seed).get_state()


@contextlib.contextmanager
def _cpu_fork(self, name="model-parallel-rng"):
    """``CudaRNGStatesTracker.fork`` on CPU: run the block on the tracked CPU generator state, then
    store its advanced state and restore the default generator."""
    if name not in self.states_:
        raise Exception(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def shims() -> CpuShims:
    """Put the patches above in place (as swaps) and return their handle.

    Returns:
        A ``CpuShims``: keep it for the process, or undo it (``with shims(): ...``) to take its patches out.

    Raises:
        RuntimeError: CUDA is available (on a GPU nothing here is installed).
    """
    if not needed():
        raise RuntimeError("the megatron-core CPU shims are for machines without a GPU; CUDA is available here")
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as mp_random

    # `torch.cuda.manual_seed` is already a silent no-op without CUDA (lazy call), as Megatron's
    # model_parallel_cuda_manual_seed needs.
    patches = [
        (torch.cuda, "current_device", lambda: "cpu"),
        (torch.cuda, "synchronize", lambda *args, **kwargs: None),
        (mp_random.CudaRNGStatesTracker, "add", _cpu_add),
        (mp_random.CudaRNGStatesTracker, "fork", _cpu_fork),
        (mp_random, "_get_cuda_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)),
        (mp_random, "_set_cuda_rng_state", lambda *args, **kwargs: None),
        (torch.Tensor, "cuda", lambda self, *args, **kwargs: self),
        (torch.nn.Module, "cuda", lambda self, *args, **kwargs: self),
        (schedules, "torch", _TorchProxy(torch)),
    ]
    return CpuShims([swap(target, name, value) for target, name, value in patches])


def install() -> None:
    """The shims for the rest of the process (the Megatron engine's), put in place once per process."""
    global _PROCESS_SHIMS
    if _PROCESS_SHIMS is None:
        _PROCESS_SHIMS = shims()


# Model-config flags that select fused CUDA kernels; all must be off on CPU.
CPU_CONFIG_FLAGS = dict(
    masked_softmax_fusion=False,
    bias_dropout_fusion=False,
    bias_activation_fusion=False,
    apply_rope_fusion=False,
    gradient_accumulation_fusion=False,
    persist_layer_norm=False,
    sequence_parallel=False,
)
