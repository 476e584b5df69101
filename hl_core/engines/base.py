"""The engine interface the trainer talks to; it knows nothing of DeepSpeed or Megatron internals."""

from __future__ import annotations

import contextlib
import math
import os
import socket
from typing import Any, Dict, Optional

import torch


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


def launch_environment(backend: Optional[str]) -> str:
    """The process-group backend (``backend``, else nccl on GPU and gloo on CPU). A plain
    ``python launchers/run.py ...`` (no launcher) gets the environment of a one-process group."""
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


class Engine:
    """Policy + reference models behind one interface.

    * ``token_logps(batch, model)``: per-token log-probs ``[B, T]`` aligned with ``batch['input_ids']``
      (``model`` is ``"policy"`` (with grad) or ``"reference"`` (no grad)).
    * ``backward(loss)``: accumulate gradients of one micro-batch.
    * ``step()``: gradient clipping + optimizer + LR scheduler at an accumulation boundary; returns
      ``{"lr": ..., "grad_norm": ...}`` or ``None`` between boundaries.
    * ``sync_reference()``: copy each rank's shard of every policy parameter into the matching
      reference shard (shard-local; never gathers).
    * ``reference``: the frozen reference model, or None when the run never reads it
      (``objectives.reference_needed``); ``has_reference`` says which, and asking for its log-probs or a
      sync without one is an error.
    * ``local_grads_finite()`` (at an accumulation boundary, before ``step``) and ``local_weights_finite()``: this
      rank's own gradient and weight shards hold no NaN/inf (local checks; the trainer shares the answers).
    * ``skip_step()``: end the update at a boundary without changing weights, optimizer or reference; returns
      ``{"lr": ..., "grad_norm": nan}``.
    * ``save(dir, tag, client_state)`` / ``load(dir, tag) -> client_state``: resumable checkpoints (every file
      loaded with ``weights_only=True``; the trainer marks a checkpoint complete after ``save`` returns).
    * ``save_hf(dir)``: a Hugging Face model directory (safetensors + tokenizer).
    """

    rank: int = 0
    world_size: int = 1
    dp_size: int = 1
    dp_rank: int = 0  # data-parallel rank: which shard of each batch this rank takes
    gradient_accumulation_steps: int = 1
    reference: Any = None
    device: torch.device = torch.device("cpu")

    @property
    def has_reference(self) -> bool:
        return self.reference is not None

    def require_reference(self):
        """The reference model (None for a LoRA reference, which lives in the policy module), or a clear error
        when this run has none (a trainer bug, not a user mistake)."""
        if not self.has_reference:
            raise RuntimeError(
                "This run built no reference model (`objectives.reference_needed` is false for its recipe), "
                "yet its reference log-probs or a reference sync were asked for."
            )
        return self.reference

    def micro_batch_positions(self, step: int, micro_index: int, micro_batch_size: int) -> range:
        """Positions in the (global, endless) data stream of this rank's share of one micro-batch:
        update ``step``, accumulation index ``micro_index``; data-parallel ranks take consecutive slices."""
        first = ((step * self.gradient_accumulation_steps + micro_index) * self.dp_size + self.dp_rank) * micro_batch_size
        return range(first, first + micro_batch_size)

    def token_logps(self, batch: Dict[str, torch.Tensor], model: str = "policy") -> torch.Tensor:
        raise NotImplementedError

    def _policy_module(self) -> torch.nn.Module:
        raise NotImplementedError

    @contextlib.contextmanager
    def policy_as_reference(self):
        """The policy in eval mode under no-grad, as the reference model runs: for log-probs the policy computes
        in place of a reference copy (a cached frozen reference, look-ahead syncing)."""
        module = self._policy_module()
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            module.train(was_training)

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def is_accumulation_boundary(self) -> bool:
        raise NotImplementedError

    def mark_accumulation_boundary(self, is_last: bool) -> None:
        """Before each backward: whether it is the update's last micro-batch (with token-budget micro-batches
        their number varies per update, so an engine must not count them). Engines whose updates always hold
        ``gradient_accumulation_steps`` micro-batches may ignore it."""

    def step(self) -> Optional[Dict[str, float]]:
        raise NotImplementedError

    def sync_reference(self) -> None:
        raise NotImplementedError

    def local_grads_finite(self) -> bool:
        raise NotImplementedError

    def local_weights_finite(self) -> bool:
        raise NotImplementedError

    def skip_step(self) -> Dict[str, float]:
        raise NotImplementedError

    def save(self, directory: str, tag: str, client_state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def load(self, directory: str, tag: Optional[str] = None) -> Dict[str, Any]:
        raise NotImplementedError

    def save_hf(self, directory: str) -> None:
        raise NotImplementedError

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sum a float tensor over all ranks (data-parallel metrics). The result is on the CPU. NCCL
        reduces only CUDA tensors, so under NCCL the values travel through this rank's GPU."""
        if torch.distributed.is_available() and torch.distributed.is_initialized() and self.world_size > 1:
            on_gpu = torch.distributed.get_backend() == "nccl"
            values = values.to(self.device) if on_gpu else values.clone()
            torch.distributed.all_reduce(values)
            values = values.cpu()
        return values

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
