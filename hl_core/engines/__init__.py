"""Engines: one small interface (``hl_core.engines.base.Engine``), one file per backend."""

import importlib
import importlib.util
import os
import warnings

import torch

from ..config import EngineSpec
from .base import Engine

# recipe `engine.name` -> (module under hl_core.engines, class); imported lazily (heavy dependencies)
ENGINES = {
    "deepspeed": ("deepspeed_engine", "DeepSpeedEngine"),
    "megatron": ("megatron_engine", "MegatronEngine"),
}


# megatron-core's warnings that say it runs without optional accelerations (Transformer Engine, Apex) or, on a CPU,
# about GPU settings: harmless for this pack (it uses megatron-core's PyTorch paths), and, repeated per module and
# per rank, they were two thirds of a CPU run's log. Hidden, and said once in one line.
MEGATRON_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed",
                    "full scope is deprecated")
MEGATRON_CPU_NOTICES = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def quiet_megatron() -> str:
    """Filter megatron-core's known harmless warnings (before it is imported); the one line to print instead."""
    for text in MEGATRON_NOTICES + (MEGATRON_CPU_NOTICES if not torch.cuda.is_available() else ()):
        warnings.filterwarnings("ignore", message=f".*{text}", category=UserWarning, module="megatron")
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return ""
    return (f"megatron-core: {' and '.join(missing)} not installed, so it uses its PyTorch implementations (its "
            "warnings saying so are hidden).")


def build_engine(spec: EngineSpec, tokenizer) -> Engine:
    """Instantiate the engine named by ``engine.name``, from what an engine reads (``hl_core.config.engine_spec``)."""
    if spec.engine.name == "megatron":
        notice = quiet_megatron()
        if notice and os.environ.get("RANK", "0").strip() == "0":
            print(notice, flush=True)
    module, cls = ENGINES[spec.engine.name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(spec, tokenizer)


__all__ = ["Engine", "ENGINES", "build_engine"]
