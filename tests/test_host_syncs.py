"""Host synchronisations per optimizer update, counted through the real trainer (DPO, KTO, GRPO offline; 1, 2 and 4
micro-batches): at most 3, and as many with 4 micro-batches as with 1 (issue 40).

A *host synchronisation* is a read of a device value on the host: ``Tensor.item`` / ``__float__`` / ``__int__`` /
``__bool__`` / ``__index__`` / ``__format__`` / ``tolist`` / ``numpy`` / ``cpu``, or an operation whose output size
depends on the values (``nonzero``, ``masked_select``, ``unique``), called (directly, or through torch's own functions)
from an ``hl_core`` frame. Torch's and DeepSpeed's internals are not counted (e.g. Adam's step
counter). Everything runs on the CPU here, so "device" is decided by provenance (``HostProvenance``): a tensor is
host-side by design when it is one of the collated batch's, the result of ``engine.all_reduce_sum`` (each call counts
as one synchronisation instead: under NCCL its ``.cpu()`` is one), created on the host without a device argument, or
computed only from such tensors; a move to an explicit device (``.to(device)``, ``device=``) makes a device tensor,
as it would on a GPU.
"""

import os
import sys
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from hl_core.config import load_recipe
from hl_core.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
HL_CORE = str(REPO / "hl_core") + os.sep
TORCH = str(Path(torch.__file__).resolve().parent) + os.sep
HERE = str(Path(__file__).resolve())
READS = {torch.Tensor.item, torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.__bool__,
         torch.Tensor.__index__, torch.Tensor.__format__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
         # operations whose output size depends on the values: the host waits for them too
         torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select, torch.masked_select, torch.unique,
         torch.Tensor.unique}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
MAX_SYNCS_PER_UPDATE = 3


def _explicit_device(func, args, kwargs) -> bool:
    if _to_cpu_by_name(func, args, kwargs):
        return False
    if kwargs.get("device") is not None:
        return True
    if func in MOVES:
        return any(isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args[1:])
    return False


def _to_cpu_by_name(func, args, kwargs) -> bool:
    """``.to("cpu", ...)`` / ``.to(device="cpu")``: the code names the host. (On the CPU a move to the engine's
    device, ``torch.device("cpu")``, looks the same; the code base moves to devices by ``torch.device`` objects and to
    the host by name, so the name tells them apart.)"""
    return func is torch.Tensor.to and any(isinstance(a, str) and a == "cpu" for a in (*args[1:], kwargs.get("device")))


class HostProvenance(TorchFunctionMode):
    """Tracks which tensors are host-side by design (see the module docstring) and counts the reads of the others
    made from ``hl_core`` frames (``syncs``: per call site)."""

    def __init__(self):
        super().__init__()
        self._host = {}  # id -> weak reference (tensors compare elementwise, so no WeakSet)
        self.syncs = Counter()
        self.counting = True

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self._host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _set(self, tensor: torch.Tensor, host: bool) -> None:
        if host:
            self._host[id(tensor)] = weakref.ref(tensor)
        else:
            self._host.pop(id(tensor), None)

    def mark_host(self, value) -> None:
        for leaf in tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                self._set(leaf, True)

    def _caller(self):
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(TORCH) or frame.f_code.co_filename == HERE):
            frame = frame.f_back
        return frame

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        to_host = func in (torch.Tensor.cpu, torch.Tensor.numpy) or _to_cpu_by_name(func, args, kwargs)
        if to_host and kwargs.get("non_blocking"):  # an asynchronous copy back: no wait (pinned memory on a GPU)
            to_host = "async"
        # indexing by a boolean mask on the device reads the mask's count back
        device_mask = func is torch.Tensor.__getitem__ and any(
            isinstance(t, torch.Tensor) and t.dtype == torch.bool and not self.is_host(t) for t
            in tree_leaves(args[1:]))
        if func in READS or to_host is True or device_mask:
            if self.counting and (device_mask or (inputs and not self.is_host(inputs[0]))):
                caller = self._caller()
                if caller is not None and caller.f_code.co_filename.startswith(HL_CORE):
                    where = caller.f_code.co_filename[len(str(REPO)) + 1:]
                    self.syncs[f"{getattr(func, '__name__', func)} {where}:{caller.f_lineno}"] += 1
        out = func(*args, **kwargs)
        moved = _explicit_device(func, args, kwargs)
        host = bool(to_host) or ((not moved) and all(self.is_host(t) for t in inputs))
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if moved and len(outputs) == 1 and any(outputs[0] is t for t in inputs) and not outputs[0].requires_grad:
            out = outputs[0].detach()  # a no-op move on the CPU: a distinct alias, a device tensor on a GPU
            outputs = [out]
        for tensor in outputs:
            self._set(tensor, host)
        return out


def _instrument(trainer, mode: HostProvenance) -> None:
    """The collated batches are host-side; each ``all_reduce_sum`` counts one synchronisation, its result host-side."""
    batches, reduce = trainer.source.batches, trainer.engine.all_reduce_sum

    def tagged_batches(n):
        result = batches(n)
        mode.mark_host([{k: v for k, v in b.items() if isinstance(v, torch.Tensor)} for b in result])
        return result

    def counted_reduce(values):
        counting, mode.counting = mode.counting, False
        try:
            out = reduce(values)
        finally:
            mode.counting = counting
        if counting:
            mode.syncs["engine.all_reduce_sum"] += 1
        mode.mark_host(out)
        return out

    trainer.source.batches = tagged_batches
    trainer.engine.all_reduce_sum = counted_reduce


def _trainer(tmp_path, recipe: str, micro_batches: int, extra=()) -> Trainer:
    recipe = load_recipe(REPO / "recipes" / "tiny" / recipe, [
        f"output_dir={tmp_path / 'run'}", "train.max_steps=4", "eval.every=null", "checkpoint.save_every=null",
        "checkpoint.save_final=false", "logging.progress_bar=false", "train.micro_batch_size=2",
        f"train.gradient_accumulation_steps={micro_batches}", *extra,
    ])
    trainer = Trainer(recipe)
    trainer.setup()
    return trainer


def count_syncs(trainer: Trainer, updates: int = 2) -> list:
    """Per update (after a first, uncounted one): the ``Counter`` of synchronisations by call site."""
    trainer.train_step()
    mode = HostProvenance()
    _instrument(trainer, mode)
    counts = []
    with mode:
        for _ in range(updates):
            mode.syncs = Counter()
            trainer.train_step()
            counts.append(mode.syncs)
    return counts


# the log-prob paths: the logits, from the hidden states (`train.fused_logprobs`), and packed (with either)
PATHS = {"logits": [], "fused": ["train.fused_logprobs=true"], "packed": ["data.packing=true"],
         "packed_fused": ["data.packing=true", "train.fused_logprobs=true"]}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("recipe", ["humanline_dpo.yaml", "humanline_kto.yaml", "humanline_grpo.yaml"])
def test_host_syncs_per_update_are_few_and_independent_of_the_micro_batches(tmp_path, recipe, path):
    totals = {}
    for micro_batches in (1, 2, 4):
        trainer = _trainer(tmp_path / str(micro_batches), recipe, micro_batches, PATHS[path])
        try:
            counts = count_syncs(trainer)
        finally:
            trainer.close()
        for syncs in counts:
            assert sum(syncs.values()) <= MAX_SYNCS_PER_UPDATE, (recipe, path, micro_batches, dict(syncs))
        totals[micro_batches] = [sum(s.values()) for s in counts]
    assert totals[1] == totals[2] == totals[4], (recipe, path, totals)


def test_the_counter_sees_a_read_of_a_device_value_and_not_one_of_the_batch(tmp_path):
    """The counter can fail: the gradient check read on the host (``local_grads_finite``, an ``hl_core`` frame) is
    one synchronisation; a read of the collated batch is none; a read of a value computed from the model is one."""
    trainer = _trainer(tmp_path, "humanline_dpo.yaml", 1)
    try:
        trainer.train_step()
        mode = HostProvenance()
        _instrument(trainer, mode)
        with mode:
            batch = trainer.source.batches(trainer.updates_done)[0]
            trainer.engine.backward(trainer._loss(batch, train=True)[0])
            assert trainer.engine.local_grads_finite()
            assert sum(mode.syncs.values()) == 1 and "base.py" in next(iter(mode.syncs)), dict(mode.syncs)
            mode.syncs = Counter()
            from hl_core.objectives.base import weighted_mean  # an hl_core frame reading host-side weights

            weighted_mean(torch.ones(2), batch["attention_mask"][:2, 0].float())
            assert sum(mode.syncs.values()) == 0, dict(mode.syncs)
            with torch.no_grad():
                weights = trainer.engine.token_logps(batch, "policy")[:2, -1].exp()
            weighted_mean(torch.ones(2), weights)
            assert sum(mode.syncs.values()) == 1, dict(mode.syncs)
    finally:
        trainer.close()
