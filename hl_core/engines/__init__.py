"""Engines: one small interface (``hl_core.engines.base.Engine``), one file per backend."""

from .base import Engine


def build_engine(recipe, tokenizer) -> Engine:
    """Instantiate the engine named by ``engine.name``."""
    if recipe.engine.name == "deepspeed":
        from .deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(recipe, tokenizer)
    raise NotImplementedError(f"engine `{recipe.engine.name}` is not available yet")


__all__ = ["Engine", "build_engine"]
