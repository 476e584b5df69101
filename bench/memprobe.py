"""Memory probes for the benches: the GPU's allocator counters, or the process's resident set on the CPU.

On the CPU the process's resident set (``VmRSS``) and its high-water mark (``VmHWM``, reset through
``/proc/self/clear_refs``) stand in for the allocator. They track live tensors closely once glibc hands
large blocks straight back to the kernel: run the measured process with ``CPU_ALLOCATOR_ENV`` in its
environment (any block over 64 KiB is its own mapping, returned on free). What the process held before
the measurement starts (interpreter, libraries, data) is the baseline to subtract.
"""

from __future__ import annotations

from typing import Dict

from hl_core.rehearsal.memory import proc_status_bytes

GIB = 1024 ** 3
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "2"}


class RssProbe:
    """Bytes resident in this process (CPU)."""

    def current(self) -> int:
        return proc_status_bytes("VmRSS:")

    def reset_peak(self) -> None:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")

    def peak(self) -> int:
        return proc_status_bytes("VmHWM:")

    def sync(self) -> None:
        pass


class CudaProbe:
    """Bytes allocated by PyTorch's CUDA allocator on ``device``."""

    def __init__(self, device):
        self.device = device

    def sync(self) -> None:
        import torch

        torch.cuda.synchronize(self.device)

    def current(self) -> int:
        import torch

        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated(self.device)


def probe_for(engine):
    return CudaProbe(engine.device) if engine.device.type == "cuda" else RssProbe()


def phase_memory(trainer, probe, base: int = 0) -> Dict[str, Dict[str, float]]:
    """One update of ``trainer`` with each engine call instrumented: GiB held (above ``base``) before and
    after the call and the peak inside it (the largest over the update's calls of that kind; ``before`` and
    ``after`` are the last call's). The calls themselves are unchanged."""
    engine, phases = trainer.engine, {}

    def wrap(name, call):
        def instrumented(*args, **kwargs):
            probe.sync()
            probe.reset_peak()
            before = probe.current()
            out = call(*args, **kwargs)
            probe.sync()
            model = args[1] if len(args) > 1 else kwargs.get("model", "policy")
            key = f"{name}:{model}" if name == "token_logps" else name
            peak, after = probe.peak(), probe.current()
            old = phases.get(key, {"peak": 0.0})
            phases[key] = {"before": (before - base) / GIB, "peak": max(old["peak"], (peak - base) / GIB),
                           "after": (after - base) / GIB}
            return out

        return instrumented

    names = [n for n in ("token_logps", "backward", "step") if hasattr(engine, n)]
    for name in names:
        setattr(engine, name, wrap(name, getattr(engine, name)))
    try:
        trainer.train_step()
    finally:
        for name in names:
            delattr(engine, name)  # back to the class's methods
    return phases
