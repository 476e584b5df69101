"""DeepSpeed's checkpoint files read without running anyone's code: a checkpoint engine whose ``load`` is
``hl_core.storage.checkpoints.safe_load`` (``torch.load(weights_only=True)``) with an allowlist of exactly the
classes DeepSpeed stores. Our trainer's DeepSpeed engine installs it; ``hl_core.humanline.weights_only_checkpoints``
installs it on your own loop's engine. Imports DeepSpeed only when called."""

from __future__ import annotations

from typing import Callable, Optional

from ..storage.checkpoints import safe_load


def deepspeed_safe_globals() -> list:
    """The classes DeepSpeed 0.19 pickles into its checkpoint files (optimizer states: the loss scaler, the
    ZeRO stage enum, fragment addresses of the bf16/ZeRO-1/2 partitions), found by saving ZeRO 0-3 x
    fp32/bf16 x clipping on/off and listing each file's globals. Nothing with code to run."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_checkpoint_engine(config, refusal: Optional[Callable[[str, str, str], Exception]] = None):
    """A DeepSpeed checkpoint engine whose ``load`` is ``safe_load`` with DeepSpeed's allowlist; ``refusal`` makes
    the error a refused file raises (``safe_load``'s argument; default: the launcher's ``RecipeError``)."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeTorchCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return safe_load(path, map_location=map_location, allowed=deepspeed_safe_globals(), refusal=refusal)

    return SafeTorchCheckpointEngine(config)
