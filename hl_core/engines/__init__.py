"""Engines: one small interface (``hl_core.engines.base.Engine``), one file per backend."""

import importlib

from .base import Engine

# recipe `engine.name` -> (module under hl_core.engines, class); imported lazily (heavy dependencies)
ENGINES = {
    "deepspeed": ("deepspeed_engine", "DeepSpeedEngine"),
    "megatron": ("megatron_engine", "MegatronEngine"),
}


def build_engine(recipe, tokenizer) -> Engine:
    """Instantiate the engine named by ``engine.name``."""
    module, cls = ENGINES[recipe.engine.name]
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)(recipe, tokenizer)


__all__ = ["Engine", "ENGINES", "build_engine"]
