"""One rank of a rehearsal, in this process: join the fake world, build the recipe's trainer and engine for
real, run a few updates, and measure (``memory.py``, ``world.py``) while the trainer does what it always does.

Updates: 0 warms up (optimizer states, DeepSpeed's first trace, the first rollout), 1 is measured (memory
ledger, saved-tensor hooks, collective traffic; the reference sync is placed on it), 2 is timed with nothing
but the phase clocks attached (only with real kernels: shape-only kernels make a time meaningless).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import load_recipe
from ..errors import UserError
from ..models.loading import rehearsal_weights
from ..models.specs import check_layout, resolve_spec
from ..preflight.plan import memory_plan, world_size_of
from ..trainer import Trainer
from .inputs import MEASURED_UPDATE, SyntheticSampler, micro_batch_cap, rehearsal_overrides
from .kernels import ShapeOnlyKernels
from .memory import ProcessMemory, TensorLedger, at_rest, largest_stepped_numel
from .world import CollectiveTraffic, join_fake_world, skip_cross_rank_checks

PER_MICRO_BATCH = ("forward", "reference", "backward")  # phases that run once per micro-batch


class ZeroedGradients:
    """A rehearsal's gradients are meaningless, and now and then one holds a NaN or inf (a buffer no faked rank
    filled: seen once in about 17 CPU rehearsals of the Gemma-2-27B megatron stage 0, never reproduced). The
    trainer's guard would then skip that update's optimizer step, and with it the step's memory and, after a
    skipped warm-up, the optimizer states at rest. So the engine's ``local_grads_nonfinite`` is wrapped: a gradient
    tensor whose norm is not finite is zeroed where it is not finite (in place: nothing allocated) and recorded
    (``events``: update, shape, dtype), and the guard sees finite gradients. A real run never gets here."""

    def __init__(self, engine):
        self.events: List[Dict] = []
        self.checks = 0
        self._engine, self._original = engine, engine.local_grads_nonfinite
        engine.local_grads_nonfinite = self

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        update, self.checks = self.checks, self.checks + 1
        nonfinite = self._original()
        if not bool(nonfinite):  # a host read: a rehearsal measures memory and traffic, not synchronisations
            return nonfinite
        for grad in self._engine.local_grads():
            if not bool(torch.linalg.vector_norm(grad).isfinite()):
                torch.nan_to_num_(grad, nan=0.0, posinf=0.0, neginf=0.0)
                self.events.append(dict(update=update, shape=list(grad.shape), dtype=str(grad.dtype).split(".")[-1]))
        return self._original()


class RehearsalMode(TorchDispatchMode):
    """Sees every operation: collectives go to the traffic counter (and the receive shim), new storages to the
    memory ledger (an output whose storage is one of the inputs' is a view or an in-place result, not new)."""

    def __init__(self, traffic: CollectiveTraffic, ledger: TensorLedger):
        super().__init__()
        self.traffic, self.ledger = traffic, ledger

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if CollectiveTraffic.is_collective(func):
            self.traffic.before(func, args, kwargs)
            out = func(*args, **kwargs)
            self.traffic.after(func, args, kwargs)
            return out
        out = func(*args, **kwargs)
        if self.ledger.on:
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type != "meta"}
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta" \
                        and tensor.untyped_storage().data_ptr() not in inputs:
                    self.ledger.created(tensor)
        return out


class Phases:
    """Which part of the update is running (for the ledger's categories and the traffic table) and how long
    each took (outermost phase only)."""

    def __init__(self, ledger: TensorLedger, traffic: CollectiveTraffic, device: torch.device):
        self.ledger, self.traffic, self.device = ledger, traffic, device
        self.stack: List[str] = []
        self.seconds: Dict[str, float] = {}
        self.micro_batches = 0
        self.backward_count = 0  # every micro-batch's backward of the rehearsal (not reset between updates)
        self.on_backward = None  # called with that count after each backward (``Progress``)
        self.last_micro_batch = False
        self.backward_live = 0  # ledger bytes of the backward phase live after the latest backward

    def _set(self, phase: str) -> None:
        self.ledger.phase = phase
        boundary = phase == "backward" and self.last_micro_batch
        self.traffic.phase = "backward-boundary" if boundary else phase

    @contextlib.contextmanager
    def running(self, phase: Optional[str]):
        if phase is None:
            yield
            return
        outer = not self.stack
        self.stack.append(phase)
        self._set(phase)
        start = time.perf_counter()
        try:
            yield
        finally:
            if outer:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            self.stack.pop()
            self._set(self.stack[-1] if self.stack else "other")

    def wrap(self, obj, name: str, phase_of) -> None:
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            with self.running(phase_of(*args, **kwargs)):
                out = original(*args, **kwargs)
            if name == "backward":
                self.micro_batches += 1
                self.backward_count += 1
                if self.ledger.on:
                    self.backward_live = self.ledger.live.get("backward", 0)
                if self.on_backward is not None:
                    self.on_backward(self.backward_count)
            return out

        setattr(obj, name, wrapped)

    def instrument(self, trainer) -> None:
        def logps_phase(batch, model="policy", *args, **kwargs):
            if self.stack and self.stack[-1] in ("sync", "rollout"):
                return None  # the look-ahead's or the rollout's forwards belong to those
            return "forward" if model == "policy" and torch.is_grad_enabled() else "reference"

        def boundary(is_last):
            self.last_micro_batch = bool(is_last)

        engine = trainer.engine
        self.wrap(engine, "token_logps", logps_phase)
        self.wrap(engine, "backward", lambda *a, **k: "backward")
        self.wrap(engine, "step", lambda *a, **k: "step")
        self.wrap(engine, "skip_step", lambda *a, **k: "step")
        original_mark = engine.mark_accumulation_boundary
        engine.mark_accumulation_boundary = lambda is_last: (boundary(is_last), original_mark(is_last))[1]
        self.wrap(trainer.reference, "before_optimizer_step", lambda *a, **k: "sync")
        self.wrap(trainer.source, "before_step", lambda *a, **k: "rollout")

    def reset(self) -> None:
        self.seconds, self.micro_batches = {}, 0


UPDATE_ROLES = {0: "warm-up", MEASURED_UPDATE: "measured", MEASURED_UPDATE + 1: "timed"}
PROGRESS_EVERY_S = 10.0  # a line at most this often within an update (always at its last micro-batch)


def progress_line(rank: int, world: int, text: str, elapsed: float) -> str:
    return f"rehearsal rank {rank} of {world}: {text} ({elapsed:.0f}s)"


def micro_batch_words(count: int, per_update: int, updates: int) -> str:
    """Where the ``count``-th backward of the rehearsal stands: its update (and that update's role) and its
    micro-batch."""
    update, micro = divmod(count - 1, per_update)
    role = UPDATE_ROLES.get(update, "")
    return (f"update {update + 1} of {updates}" + (f" ({role})" if role else "")
            + f", micro-batch {micro + 1} of {per_update}")


class Progress:
    """The lines a rehearsal prints while it runs (a rank can take minutes on a CPU): the engine build, then each
    micro-batch's backward, at most one line per ``PROGRESS_EVERY_S`` within an update, and each update's end."""

    def __init__(self, rank: int, world: int, updates: int):
        self.rank, self.world, self.updates = rank, world, updates
        self.start = self.last = time.perf_counter()

    def say(self, text: str) -> None:
        self.last = time.perf_counter()
        print(progress_line(self.rank, self.world, text, self.last - self.start), flush=True)

    def attach(self, phases: "Phases", per_update: int) -> None:
        self.say(f"engine built; {self.updates} updates of {per_update} micro-batches")

        def on_backward(count: int) -> None:
            last = count % per_update == 0
            if last or time.perf_counter() - self.last >= PROGRESS_EVERY_S:
                self.say(micro_batch_words(count, per_update, self.updates))

        phases.on_backward = on_backward


def _vocab_widths(engine, vocab: int) -> List[int]:
    tp = engine.tp
    return sorted({vocab, vocab // tp})


def _checked_world(recipe, rank: int, micro_batches) -> int:
    """The recipe's world size, once the layout fits it, ``rank`` is in it and ``micro_batches`` is at least 2."""
    world = world_size_of(recipe)
    check_layout(recipe, world)
    if not 0 <= rank < world:
        raise UserError(f"`--rehearse-rank {rank}` is outside the recipe's world of {world} ranks "
                        f"(`cluster.nodes` x `cluster.gpus_per_node`). Fix: choose a rank in [0, {world}).")
    if micro_batches not in (None, "all") and int(micro_batches) < 2:
        raise UserError(f"`--rehearse-micro-batches {micro_batches}`: at least 2 (one non-final micro-batch and the "
                        "final one, whose backward carries the update's gradient reduction). Fix: pass 2 or more, "
                        "or `all`.")
    return world


def _measured_updates(trainer, phases: "Phases", ledger: TensorLedger, traffic: CollectiveTraffic,
                      process: ProcessMemory, before_engine: int, device: torch.device, timed: bool) -> tuple:
    """The warm-up updates, the measured one (memory by owner and phase, the collectives counted) and, when
    ``timed``, one more for the phases' wall-clock times. Returns the rows, the memory terms, the measured update's
    micro-batches and the times (or None)."""
    engine = trainer.engine
    rows = [trainer.train_step() for _ in range(MEASURED_UPDATE)]  # warm-up
    rest = at_rest(engine, device)
    rest_process = process.current() - before_engine
    phases.reset()
    process.reset_peak()
    ledger.on = traffic.recording = True
    ledger.reset_peaks()
    with ledger.saved_tensors_hooks():
        rows.append(trainer.train_step())
    ledger.on = traffic.recording = False
    process_peak = process.peak() - before_engine
    memory = dict(
        at_rest=rest["total"], weights=rest["weights"], optimizer=rest["optimizer"], reference=rest["reference"],
        kept_other=rest["other"], backward_gradients=phases.backward_live, step_gradients=ledger.peak.get("step", 0),
        activations=ledger.peak.get("activation", 0), logits=ledger.peak.get("logits", 0),
        peak_tensors=rest["total"] + ledger.peak_total, peak_process=process_peak, at_rest_process=rest_process,
        at_peak=ledger.at_peak, gathered=ledger.peak.get("gathered", 0),
        largest_stepped_numel=largest_stepped_numel(engine),
    )
    measured_micro, seconds = phases.micro_batches, None
    if timed:
        phases.reset()
        rows.append(trainer.train_step())
        seconds = dict(phases.seconds)
    return rows, memory, measured_micro, seconds


def rehearse_rank(recipe_path: str, overrides: List[str], rank: int, kernels: str = "auto",
                  micro_batches: Optional[int] = None, updates: int = 3) -> Dict:
    """Rehearse rank ``rank`` of the recipe's world; returns the measurements and the plan for that rank."""
    recipe = load_recipe(recipe_path, overrides)
    world = _checked_world(recipe, rank, micro_batches)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    shapes_only = kernels == "shapes" or (kernels == "auto" and device.type == "cpu")
    pp = recipe.parallel.pp if recipe.engine.name == "megatron" else 1
    micro_batches = micro_batch_cap(micro_batches, device.type == "cpu", pp)
    progress = Progress(rank, world, updates)
    progress.say(f"building the engine ({resolve_spec(recipe.model).name}, "
                 f"{'shape-only' if shapes_only else 'real'} kernels)")
    workdir = Path(tempfile.mkdtemp(prefix="hl_rehearsal_"))
    trainer = None
    try:
        extra, notes, layout = rehearsal_overrides(recipe, workdir, world, micro_batches, updates)
        rehearsed = load_recipe(recipe_path, [*overrides, *extra])
        join_fake_world(rank, world)
        if rank != 0 and recipe.engine.name == "deepspeed" and recipe.engine.zero_stage == 3:
            skip_cross_rank_checks()
        process = ProcessMemory(device)
        before_engine = process.current()
        spec = resolve_spec(recipe.model)
        traffic = CollectiveTraffic(recipe.cluster.gpus_per_node)
        with contextlib.ExitStack() as stack:
            kernel_mode = stack.enter_context(ShapeOnlyKernels()) if shapes_only else None
            stack.enter_context(rehearsal_weights())
            trainer = Trainer(rehearsed)
            trainer.setup()
            engine = trainer.engine
            zero3 = recipe.engine.name == "deepspeed" and recipe.engine.zero_stage == 3
            ledger = TensorLedger(_vocab_widths(engine, spec.vocab_size), device, gathers_weights=zero3)
            phases = Phases(ledger, traffic, device)
            phases.instrument(trainer)
            progress.attach(phases, trainer.engine.gradient_accumulation_steps)
            zeroed = ZeroedGradients(engine)
            if hasattr(trainer.source, "sampler"):
                trainer.source.sampler = SyntheticSampler(4, rehearsed.rollout.max_new_tokens,
                                                          rehearsed.data.max_length)
            stack.enter_context(RehearsalMode(traffic, ledger))
            rows, memory, measured_micro, timed = _measured_updates(
                trainer, phases, ledger, traffic, process, before_engine, device,
                timed=not shapes_only and updates > MEASURED_UPDATE + 1)
            kernels_skipped = kernel_mode.skipped if kernel_mode is not None else 0
        coords = dict(dp=engine.dp_rank, dp_size=engine.dp_size, tp=engine.tp_rank,
                      pp_stage=engine.pp_rank)
        megatron_cpu = recipe.engine.name == "megatron" and device.type == "cpu"
        plan = memory_plan(recipe, world, stage=coords["pp_stage"], distributed_optimizer=not megatron_cpu,
                           megatron_gpu=not megatron_cpu, dp_rank=coords["dp"])
        return dict(
            recipe=recipe.name, rank=rank, world_size=world, coords=coords, engine=recipe.engine.name,
            zero_stage=recipe.engine.zero_stage, precision=recipe.engine.precision, layers=spec.num_layers,
            model=spec.name, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            kernels="shapes" if shapes_only else "real", kernels_skipped=kernels_skipped, notes=notes,
            micro_batches=measured_micro, accumulation=layout["accumulation"], memory=memory,
            plan=plan, plan_flavour="megatron CPU path" if megatron_cpu else "as on GPUs",
            traffic=scaled_traffic(traffic, measured_micro, layout["accumulation"]),
            sync_bytes=sum(r.payload for r in traffic.by_kind(("sync",)).values()),
            reference_mode=trainer.reference.mode, timed=timed
            and scaled_time(timed, measured_micro, layout["accumulation"]),
            skipped_updates=sum(bool(r.get("skipped")) for r in rows), losses=[r.get("loss") for r in rows],
            zeroed_gradients=zeroed.events,
        )
    finally:
        if trainer is not None:
            trainer.close()
        shutil.rmtree(workdir, ignore_errors=True)


def scaled_traffic(traffic: CollectiveTraffic, ran: int, accumulation: int) -> Dict[str, Dict]:
    """Bytes per update, per kind: the micro-batch phases scaled from ``ran`` to ``accumulation`` micro-batches
    (the final micro-batch's backward, which carries the gradient reduction, counted once)."""
    out: Dict[str, Dict] = {}
    factors = {p: accumulation / max(ran, 1) for p in ("forward", "reference")}
    factors["backward"] = (accumulation - 1) / (ran - 1) if ran > 1 else 0.0
    for (phase, kind), row in traffic.table.items():
        factor = factors.get(phase, 1.0)
        entry = out.setdefault(kind, dict(calls=0.0, payload=0.0, wire=0.0, seconds=0.0, between_nodes=False))
        entry["calls"] += row.calls * factor
        entry["payload"] += row.payload * factor
        entry["wire"] += row.wire * factor
        entry["seconds"] += row.seconds * factor
        entry["between_nodes"] = entry["between_nodes"] or row.between_nodes
    return out


def scaled_time(seconds: Dict[str, float], ran: int, accumulation: int) -> Dict[str, float]:
    """Compute seconds per update: the micro-batch phases scaled from ``ran`` to ``accumulation`` micro-batches."""
    per_micro = sum(seconds.get(p, 0.0) for p in PER_MICRO_BATCH)
    rest = sum(v for k, v in seconds.items() if k not in PER_MICRO_BATCH)
    return dict(micro_batches_s=per_micro, other_s=rest, update_s=per_micro * accumulation / max(ran, 1) + rest)
