"""The engine interface the trainer talks to; it knows nothing of DeepSpeed or Megatron internals."""

from __future__ import annotations

import abc
import contextlib
import math
import os
import random
import socket
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from ..errors import LaunchError

# torch's global generators (dropout), Python's and NumPy's are seeded with train.seed + this + the rank: the offset
# keeps their stream apart from the humanline sampling generators (train.seed + 1000 x the data-parallel rank)
GLOBAL_SEED_OFFSET = 1_000_003


def lr_lambda(warmup_steps: int, max_steps: int, schedule: str):
    """Multiplier on the peak LR at update ``n``: linear warm-up, then constant, linear or cosine decay."""

    def fn(n: int) -> float:
        if warmup_steps and n < warmup_steps:
            return (n + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = (n - warmup_steps) / max(1, max_steps - warmup_steps)
        progress = min(max(progress, 0.0), 1.0)
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
LAUNCHERS = "torchrun, deepspeed and the SLURM script set them all"


def check_launch_environment(environ=os.environ) -> None:
    """The process-group variables a launcher sets, checked before anything waits on them: ``RANK``,
    ``WORLD_SIZE`` and ``LOCAL_RANK`` are whole numbers, given together (or none of them: one process) with
    ``0 <= RANK < WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; ``MASTER_PORT``, when given, is a port number.
    A ``LaunchError`` names the variable and the fix (unchecked, a missing ``LOCAL_RANK`` sends DeepSpeed looking
    for MPI, and a rank that no peer will join waits for ever)."""
    given = {name: environ[name] for name in LAUNCHER_VARIABLES if name in environ}
    for name, raw in given.items():
        if not raw.strip().isdigit():
            raise LaunchError(
                f"The environment variable `{name}={raw}` is not a whole number (the launcher's process numbering; "
                f"{LAUNCHERS}). Fix: start the run with `torchrun --nproc_per_node N launchers/run.py ...`, or unset "
                f"{', '.join(LAUNCHER_VARIABLES)} for one process."
            )
    one_process = {"WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    if given and "RANK" not in given and all(int(raw) == int(one_process[n]) for n, raw in given.items()):
        given = {}  # leftovers that describe one process anyway
    if given:
        missing = [name for name in LAUNCHER_VARIABLES + ("MASTER_ADDR", "MASTER_PORT")
                   if not environ.get(name, "").strip()]
        if missing:
            shown = ", ".join(f"{n}={given[n]}" for n in given)
            raise LaunchError(
                f"The environment sets {shown} but not {', '.join(missing)}: a distributed launch needs RANK, "
                f"WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT ({LAUNCHERS}); without them DeepSpeed goes "
                "looking for an MPI launch. Fix: start the run with `torchrun --nproc_per_node N launchers/run.py "
                f"...`, or unset {', '.join(given)} for one process."
            )
        rank, world = int(given["RANK"]), int(given["WORLD_SIZE"])
        if world < 1 or rank >= world:
            raise LaunchError(
                f"The environment sets RANK={rank} with WORLD_SIZE={world}: ranks run from 0 to WORLD_SIZE - 1, so "
                "this process would wait for ever for peers that never come. Fix: start the run with `torchrun "
                "--nproc_per_node N launchers/run.py ...`, or unset RANK, WORLD_SIZE and LOCAL_RANK for one process."
            )
    port = environ.get("MASTER_PORT")
    if port is not None and not (port.strip().isdigit() and 0 < int(port) < 65536):
        raise LaunchError(
            f"The environment variable `MASTER_PORT={port}` is not a port number (1-65535) for the process group's "
            "rendezvous. Fix: set a free port (e.g. `MASTER_PORT=29500`), or unset it: one process picks a free "
            "port itself."
        )


def launch_environment(backend: Optional[str]) -> str:
    """The process-group backend (``backend``, else nccl on GPU and gloo on CPU). A plain
    ``python launchers/run.py ...`` (no launcher) gets the environment of a one-process group. The launcher's
    variables are checked first (`check_launch_environment`)."""
    check_launch_environment()
    if "RANK" not in os.environ:
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    return backend or ("nccl" if torch.cuda.is_available() else "gloo")


class Engine(abc.ABC):
    """Policy + reference models behind one interface: everything the trainer and the other packages use of an
    engine is declared here (the attributes below, the abstract methods each engine defines, and the shared ones
    defined here); nothing else of an engine is read outside ``hl_core.engines`` (tests/test_engine_interface.py).

    * ``token_logps(batch, model)``: per-token log-probs ``[B, T]`` aligned with ``batch['input_ids']``
      (``model`` is ``"policy"`` (with grad) or ``"reference"`` (no grad)).
    * ``backward(loss)``: accumulate gradients of one micro-batch.
    * ``step()``: gradient clipping + optimizer + LR scheduler at an accumulation boundary; returns
      ``{"lr": ..., "grad_norm": ...}`` (the norm a float or a 0-dim device tensor, which the trainer reads in
      the update's totals reduction) or ``None`` between boundaries.
    * ``reference_pairs()``: the policy's and the reference's parameter pairs
      (``hl_core.humanline.ParameterPairs``), which ``hl_core.humanline.ReferenceSync`` syncs shard-locally.
    * ``reference``: the frozen reference model, or None when the run never reads it
      (``config.reference_needed``); ``has_reference`` says which, and asking for its log-probs or a
      sync without one is an error.
    * ``local_grads_nonfinite()`` (at an accumulation boundary, before ``step``; a 0-dim device tensor, 1.0 when
      some element is NaN/inf), ``local_grads_finite()`` (its host read) and ``local_weights_finite()``: this
      rank's own gradient and weight shards hold no NaN/inf (local checks; the trainer shares the answers);
      ``local_grads()``: those gradient tensors.
    * ``skip_step()``: end the update at a boundary without changing weights, optimizer or reference; returns
      ``{"lr": ..., "grad_norm": nan}``.
    * ``save(dir, tag, client_state)`` / ``load(dir, tag) -> client_state``: resumable checkpoints (every file
      loaded with ``weights_only=True``; the trainer marks a checkpoint complete after ``save`` returns).
    * ``save_hf(dir)``: a Hugging Face model directory (safetensors + tokenizer).
    * ``generation_module()``, ``full_state_dict()``, ``weight_buckets(bytes)``: what a sampler reads of the
      policy (an engine that cannot sample says so with a ``RecipeError``).
    * ``seed_rngs(seed)``, ``rng_state()``, ``set_rng_state(state)``: the global generators (dropout), seeded from
      ``train.seed`` and the rank at construction, kept per rank in checkpoints.
    """

    rank: int = 0
    world_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0  # data-parallel rank: which shard of each batch this rank takes
    tp: int = 1  # tensor-parallel size, and this rank's place in it
    tp_rank: int = 0
    pp: int = 1  # pipeline-parallel size (stages), and this rank's stage
    pp_rank: int = 0
    gradient_accumulation_steps: int = 1
    reference: Any = None
    device: torch.device = torch.device("cpu")
    # the optimizer the engine steps (a library's wrapper around a torch optimizer, or a torch optimizer), read by
    # the rehearsal's memory accounting; None before it is built
    optimizer: Any = None
    # set by ``load`` when the checkpoint kept no reference copy (look-ahead) and the reference restarted from the
    # policy's weights: the reference source says so
    resynced_at_resume: bool = False

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def require_reference(self):
        """The reference model (None for a LoRA reference, which lives in the policy module), or a clear error
        when this run has none (a trainer bug, not a user mistake)."""
        if not self.has_reference:
            raise RuntimeError(
                "This run built no reference model (`config.reference_needed` is false for its recipe), "
                "yet its reference log-probs or a reference sync were asked for."
            )
        return self.reference

    def micro_batch_positions(self, step: int, micro_index: int, micro_batch_size: int) -> range:
        """Positions in the (global, endless) data stream of this rank's share of one micro-batch:
        update ``step``, accumulation index ``micro_index``; data-parallel ranks take consecutive slices."""
        first = ((step * self.gradient_accumulation_steps + micro_index) * self.dp_size
                 + self.dp_rank) * micro_batch_size
        return range(first, first + micro_batch_size)

    @abc.abstractmethod
    def token_logps(self, batch: Dict[str, torch.Tensor], model: str = "policy",
                    temperature: float = 1.0) -> torch.Tensor:
        """Per-token log-probs ``[B, T]`` of ``model`` (``"policy"``, with grad, or ``"reference"``, without) at
        ``temperature``, aligned with ``batch["input_ids"]``."""

    @abc.abstractmethod
    def trained_module(self) -> torch.nn.Module:
        """The policy's torch module, unwrapped from the library's engine (the one the optimizer trains)."""

    @abc.abstractmethod
    def generation_module(self) -> contextlib.AbstractContextManager:
        """A context giving ``(policy module in eval mode, device, lockstep)`` for a sampler's decode loop
        (``lockstep``: every forward is collective, so ranks decode together)."""

    @abc.abstractmethod
    def full_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The policy's full weights in Hugging Face names (gathered; rank 0 gets them, others may get None)."""

    @abc.abstractmethod
    def weight_buckets(self, bucket_bytes: int) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """The policy's parameters as lists of ``(HF name, tensor)`` of at most ``bucket_bytes`` each, for a weight
        push into an inference engine."""

    @contextlib.contextmanager
    def policy_as_reference(self):
        """The policy in eval mode under no-grad, as the reference model runs: for log-probs the policy computes
        in place of a reference copy (a cached frozen reference, look-ahead syncing), and for held-out
        evaluations (dropout off: the same weights always give the same numbers, and no random draw is taken
        from the training's generators)."""
        module = self.trained_module()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            module.train(was_training)

    def seed_rngs(self, seed: int) -> None:
        """Seed torch's global generators (CPU and GPUs: dropout draws from them), Python's ``random`` and NumPy's
        with ``seed`` (which includes the rank: each rank its own stream)."""
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def rng_state(self) -> Dict[str, Any]:
        """This rank's global generator states (kept in each checkpoint, so a resumed run draws what an
        uninterrupted one would); only tensors, numbers and tuples (``weights_only`` loads)."""
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state = {"torch": torch.get_rng_state(), "python": random.getstate(),
                 "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate(state["python"])
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate the gradients of one micro-batch's ``loss``."""

    @abc.abstractmethod
    def is_accumulation_boundary(self) -> bool:
        """Whether the next ``step`` ends an update (the last micro-batch's backward ran)."""

    def mark_accumulation_boundary(self, is_last: bool) -> None:
        """Before each backward: whether it is the update's last micro-batch (with token-budget micro-batches
        their number varies per update, so an engine must not count them). Engines whose updates always hold
        ``gradient_accumulation_steps`` micro-batches may ignore it."""

    @abc.abstractmethod
    def step(self) -> Optional[Dict[str, float]]:
        """Clip, step the optimizer and the LR schedule at an accumulation boundary:
        ``{"lr", "grad_norm"}``; None between boundaries."""

    def reference_pairs(self):
        """The ``hl_core.humanline.ParameterPairs`` humanline's sync writes (built with the engine: the engine's
        models, or a LoRA model's adapters); an error when this run has no reference."""
        self.require_reference()
        return self._sync_pairs

    @abc.abstractmethod
    def local_grads(self) -> list:
        """This rank's gradient tensors at an accumulation boundary, before the step (each engine's own storage)."""

    @torch.no_grad()
    def local_grads_nonfinite(self) -> torch.Tensor:
        """1.0 when some local gradient element is NaN or inf, else 0.0: a 0-dim float64 tensor on the device,
        for the guard's one reduction (no host read here)."""
        grads = self.local_grads()  # the norm (fused per dtype, no copies) is finite iff every element is
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return (~torch.nn.utils.get_total_norm(grads).isfinite()).to(torch.float64)

    def local_grads_finite(self) -> bool:
        """``local_grads_nonfinite`` read on the host (one synchronisation)."""
        return not bool(self.local_grads_nonfinite())

    @abc.abstractmethod
    def local_weights_finite(self) -> bool:
        """Whether this rank's own weight shards hold no NaN or inf (a local check)."""

    @abc.abstractmethod
    def skip_step(self) -> Dict[str, float]:
        """End the update without changing weights, optimizer or reference:
        ``{"lr": ..., "grad_norm": nan}``."""

    @abc.abstractmethod
    def save(self, directory: str, tag: str, client_state: Dict[str, Any]) -> None:
        """Write this rank's share of a resumable checkpoint ``directory/tag`` with ``client_state``."""

    @abc.abstractmethod
    def load(self, directory: str, tag: Optional[str] = None) -> Dict[str, Any]:
        """Load checkpoint ``directory/tag`` (``weights_only`` loads); returns its ``client_state``."""

    @abc.abstractmethod
    def save_hf(self, directory: str) -> None:
        """Write a Hugging Face model directory (safetensors + tokenizer); collective."""

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a float tensor (on the CPU or this rank's device) over all ranks (data-parallel metrics). The result
        is a new tensor on the CPU: reading it is the call's one host synchronisation. NCCL reduces only CUDA
        tensors, so under NCCL the values travel through this rank's GPU."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            on_gpu = torch.distributed.get_backend() == "nccl"
            values = values.to(self.device) if on_gpu else values.to("cpu")
            values = values.clone() if values.device.type == "cpu" else values
            torch.distributed.all_reduce(values)
        return values.cpu() if values.device.type != "cpu" else values.clone()

    def summary_fields(self) -> Dict[str, Any]:
        """Engine facts for the run summary (e.g. ``train.compile``'s compile time and recompiles); none by default."""
        return {}

    def synchronize(self) -> None:
        """Wait for this rank's queued GPU work (so wall-clock timings measure work done, not launched)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def close(self, destroy_process_group: bool = True) -> None:
        """Tear engines (and, by default, the process group) down explicitly (needed under ZeRO-3)."""
