"""What a rehearsal measures of memory: the tensors the engine really allocated, never the plan's formulas.

* at rest: every live tensor storage on the rank's device after an update (a walk of the garbage
  collector's objects, each storage once), split into the policy's weights, the reference's, the optimizer's
  tensors (its states and the float32 master copies it steps) and the rest (gradient buffers kept between
  updates). On a GPU the allocator's ``memory_allocated`` is reported beside it.
* within an update, `TensorLedger`: every storage an operation creates (a dispatch mode sees each
  output) is entered with a category and leaves when it is freed (a weak reference on the storage), so its
  live bytes per category, and their peaks, are known at every moment:
  - ``logits``: tensors whose last dimension is the (tensor-parallel slice of the) vocabulary: the logits,
    their soft-capped copies, the float32 log-prob blocks, the logits' gradient, megatron's softmax;
  - ``activation``: tensors autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``; a
    parameter or a logits tensor is not one), and whatever a module's forward allocates while it is
    recomputed inside the backward (gradient checkpointing keeps no saved tensors of its own in view; torch's
    recomputation hooks tell an autograd.Function's forward recomputed, such as DeepSpeed ZeRO-3's linear, whose
    outputs are made with gradients off, from the backward's own tensors);
  - ``gathered``: under ZeRO-3, the whole parameters DeepSpeed gathers for a module's forward or backward;
  - otherwise the phase that allocated it: ``forward``, ``reference`` (forwards without gradient),
    ``backward`` (gradients), ``sync``, ``step``.
  The measured terms: activations = the peak of live ``activation`` bytes; logits = the peak of live
  ``logits`` bytes; gradients during backward = the ``backward`` bytes still live after the update's last
  backward; float32 gradients at step = the peak of live ``step`` bytes within the optimizer step; peak
  (tensors) = at rest + the peak of all live ledger bytes.
* the process: on the CPU, the resident set's high-water mark (``VmHWM``, reset before the measured update)
  above the resident set before the engine existed, with glibc returning large blocks at once (``mallopt``)
  so that it follows the tensors; on a GPU, ``max_memory_allocated`` above the allocation before the engine.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import weakref
from typing import Dict, Iterable, Optional, Set

import torch

GIB = 1024 ** 3
ACTIVATION_SOURCES = ("forward", "backward")  # phases whose saved tensors are activations
ZERO_FETCH = "deepspeed/runtime/zero/partition_parameters.py"  # where DeepSpeed's ZeRO-3 gathers parameters
# DeepSpeed's float32 master copies, which its torch optimizer steps (ZeRO-3, ZeRO-1/2, bf16 ZeRO-0); ZeRO-3 hands
# them to the torch optimizer only for the duration of a step
RECOMPUTATION_HOOK = "_recomputation_hook"  # torch.utils.checkpoint's hooks while it recomputes a forward
MASTER_COPIES = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def storage_key(tensor: torch.Tensor):
    """``(storage object, bytes)`` of a real tensor's storage, or None (meta and empty tensors)."""
    if tensor.device.type == "meta":
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
        return None
    size = storage.nbytes()
    return (storage, size) if size else None


class TensorLedger:
    """Live bytes of the storages created while it is on, by category (see the module docstring)."""

    def __init__(self, vocab_widths: Iterable[int], device: torch.device, gathers_weights: bool = False):
        self.vocab_widths: Set[int] = {int(v) for v in vocab_widths if v}
        self.gathers_weights = gathers_weights  # ZeRO-3: whole parameters gathered for a module's forward/backward
        self.device_type = device.type
        self.on = False
        self.phase = "other"
        self.entries: Dict[int, list] = {}  # storage address -> [bytes, category]
        self.live: Dict[str, int] = {}
        self.peak: Dict[str, int] = {}
        self.total = self.peak_total = 0
        self.at_peak: Dict[str, int] = {}

    # ------------------------------------------------------------------------------------ bookkeeping
    def reset_peaks(self) -> None:
        self.peak = dict(self.live)
        self.peak_total = self.total
        self.at_peak = dict(self.live)

    def _add(self, category: str, size: int) -> None:
        self.live[category] = self.live.get(category, 0) + size
        self.peak[category] = max(self.peak.get(category, 0), self.live[category])
        self.total += size
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.at_peak = dict(self.live)  # what the peak is made of

    def _remove(self, address: int) -> None:
        entry = self.entries.pop(address, None)
        if entry is not None:
            self.live[entry[1]] -= entry[0]
            self.total -= entry[0]

    def category_of(self, tensor: torch.Tensor) -> str:
        if tensor.dim() >= 2 and tensor.shape[-1] in self.vocab_widths:
            return "logits"
        if self.gathers_weights and _gathering_weights():
            return "gathered"
        # autograd runs backward functions with gradients off; a forward with gradients on inside its engine is
        # gradient checkpointing's recomputation (torch's and megatron's alike), and so is one with gradients off
        # under torch's recomputation hooks: an autograd.Function's forward recomputed (DeepSpeed ZeRO-3's linear)
        if torch._C._current_graph_task_id() != -1 and (torch.is_grad_enabled() or _recomputing()):
            return "activation"
        return self.phase

    def created(self, tensor: torch.Tensor) -> None:
        """An operation's output: enter its storage if it is new."""
        if not self.on or tensor.device.type != self.device_type:
            return
        found = storage_key(tensor)
        if found is None:
            return
        storage, size = found
        address = storage.data_ptr()
        if address in self.entries:
            return
        self.entries[address] = [size, self.category_of(tensor)]
        self._add(self.entries[address][1], size)
        weakref.finalize(storage, self._remove, address)

    def saved(self, tensor: torch.Tensor) -> None:
        """A tensor autograd keeps for backward: its storage becomes an activation (parameters and logits
        stay what they are)."""
        if not self.on or isinstance(tensor, torch.nn.Parameter) or hasattr(tensor, "ds_id"):
            return
        found = storage_key(tensor)
        entry = self.entries.get(found[0].data_ptr()) if found else None
        if entry is None or entry[1] not in ACTIVATION_SOURCES:
            return
        self.live[entry[1]] -= entry[0]
        self.total -= entry[0]
        entry[1] = "activation"
        self._add("activation", entry[0])

    def saved_tensors_hooks(self):
        def pack(tensor):
            self.saved(tensor)
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)


def _recomputing() -> bool:
    """Whether torch's non-reentrant checkpoint is recomputing a forward: its recomputation hooks are the
    innermost saved-tensor hooks (they stay on inside an autograd.Function's forward, where gradients are off)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return bool(top) and getattr(top[0], "__qualname__", "").startswith(RECOMPUTATION_HOOK)


def _gathering_weights() -> bool:
    """Whether the running Python code is ZeRO-3 gathering a module's parameters (DeepSpeed's fetch in a
    forward pre-hook): weights, not activations, although a recomputed forward asked for them."""
    frame = sys._getframe(2)
    for _ in range(12):  # the allocation is made inside the gathering function, a few frames above the dispatch
        if frame is None:
            return False
        if ZERO_FETCH in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


# --------------------------------------------------------------------------------------------- at rest
def live_storages(device: torch.device) -> Dict[int, int]:
    """Address -> bytes of every tensor storage on ``device`` that Python code can reach."""
    gc.collect()
    found: Dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            is_tensor = isinstance(obj, torch.Tensor)
        except ReferenceError:
            continue
        if not is_tensor or obj.device.type != device.type:
            continue
        key = storage_key(obj)
        if key is not None:
            found[key[0].data_ptr()] = key[1]
    return found


def _owned(tensors: Iterable[torch.Tensor]) -> Dict[int, int]:
    out = {}
    for tensor in tensors:
        if tensor is None:
            continue
        tensor = getattr(tensor, "ds_tensor", tensor)  # ZeRO-3: this rank's partition
        key = storage_key(tensor)
        if key is not None:
            out[key[0].data_ptr()] = key[1]
    return out


def inner_optimizer(optimizer) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside DeepSpeed's or megatron's wrappers."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and seen < 8:
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def optimizer_tensors(optimizer) -> list:
    """Every tensor a torch optimizer holds: its states and the parameters it steps (for a mixed-precision
    wrapper, the float32 master copies); megatron's distributed optimizer may hold several."""
    optimizers = list(getattr(optimizer, "chained_optimizers", [])) or [optimizer]
    tensors = []
    for wrapped in optimizers:
        for name in MASTER_COPIES:
            tensors += [t for t in getattr(wrapped, name, None) or [] if torch.is_tensor(t)]
        inner = inner_optimizer(wrapped)
        if inner is None:
            continue
        for state in inner.state.values():
            tensors += [t for t in state.values() if torch.is_tensor(t)]
        tensors += [p for group in inner.param_groups for p in group["params"]]
    return tensors


def largest_stepped_numel(engine) -> int:
    """Elements of the largest tensor the optimizer steps (a master copy or a parameter): the size of the CPU
    step's per-tensor float32 temporaries (a shape, read off the optimizer; no memory is inferred from it)."""
    optimizer = engine.optimizer
    wrappers = list(getattr(optimizer, "chained_optimizers", [])) or [optimizer]
    stepped = [t for w in wrappers for name in MASTER_COPIES for t in getattr(w, name, None) or []
               if torch.is_tensor(t)]
    inner = [inner_optimizer(w) for w in wrappers]
    stepped += [p for o in inner if o is not None for group in o.param_groups for p in group["params"]]
    return max((t.numel() for t in stepped), default=0)


def at_rest(engine, device: torch.device) -> Dict[str, int]:
    """Bytes live between updates, split by owner (each storage counted once, in the first owner that holds
    it: policy, reference, optimizer, then the rest)."""
    live = live_storages(device)
    policy = engine.trained_module()
    owners = {"weights": _owned(policy.parameters())}
    reference = engine.reference
    reference = getattr(reference, "module", reference)
    owners["reference"] = _owned(reference.parameters()) if isinstance(reference, torch.nn.Module) else {}
    owners["optimizer"] = _owned(optimizer_tensors(engine.optimizer))
    out, claimed = {}, set()
    for name, owned in owners.items():
        keys = [k for k in owned if k in live and k not in claimed]
        claimed.update(keys)
        out[name] = sum(live[k] for k in keys)
    out["other"] = sum(size for key, size in live.items() if key not in claimed)
    out["total"] = sum(live.values())
    return out


# --------------------------------------------------------------------------------------------- process
class ProcessMemory:
    """The process's own figure: the resident set (CPU) or the CUDA allocator (GPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        if not self.cuda:
            _return_large_blocks()

    def current(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device)
        return proc_status_bytes("VmRSS:")

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return proc_status_bytes("VmHWM:")


def proc_status_bytes(field: str) -> int:
    """A byte count of this process from ``/proc/self/status`` (``VmRSS:``, ``VmHWM:``)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _return_large_blocks() -> None:
    """glibc: every block over 64 KiB its own mapping, handed back to the kernel when freed (what
    ``bench/memprobe.py`` sets through the environment), so the resident set follows the live tensors."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: the resident set is still reported, with whatever the allocator keeps
        return
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8
    libc.mallopt(m_mmap_threshold, 65536)
    libc.mallopt(m_trim_threshold, 0)
    libc.mallopt(m_arena_max, 2)
