"""DeepSpeed's checkpoint files read without running anyone's code: a checkpoint engine whose ``load`` is
``safe_load`` (``torch.load(weights_only=True)``) with an allowlist of exactly the classes DeepSpeed stores. Our
trainer's DeepSpeed engine installs it; ``hl_core.humanline.weights_only_checkpoints`` installs it on your own loop's
engine.

DeepSpeed's classes are looked up by name (``importlib``) when an engine asks for them, by which time DeepSpeed is
imported: this module imports no engine library (``hl_core.config`` and ``hl_core.humanline``, which reach it, must
not)."""

from __future__ import annotations

import importlib
from typing import Callable, Optional

from .checkpoints import safe_load

# (module, name) of each class DeepSpeed 0.19 pickles into its checkpoint files (optimizer states: the loss scaler,
# the ZeRO stage enum, fragment addresses of the bf16/ZeRO-1/2 partitions), found by saving ZeRO 0-3 x fp32/bf16 x
# clipping on/off and listing each file's globals. Nothing with code to run.
SAFE_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)
CHECKPOINT_ENGINE = ("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine")


def _deepspeed(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed stores in its checkpoint files (``SAFE_CLASSES``)."""
    return [_deepspeed(module, name) for module, name in SAFE_CLASSES]


def safe_checkpoint_engine(config, refusal: Optional[Callable[[str, str, str], Exception]] = None):
    """A DeepSpeed checkpoint engine whose ``load`` is ``safe_load`` with DeepSpeed's allowlist; ``refusal`` makes
    the error a refused file raises (``safe_load``'s argument; default: the launcher's ``RecipeError``)."""

    class SafeTorchCheckpointEngine(_deepspeed(*CHECKPOINT_ENGINE)):
        def load(self, path: str, map_location=None):
            return safe_load(path, map_location=map_location, allowed=deepspeed_safe_globals(), refusal=refusal)

    return SafeTorchCheckpointEngine(config)
