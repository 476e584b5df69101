"""The top level of a recipe: ``Recipe``, one training run, made of the groups in ``sections*.py``."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator

from ..errors import did_you_mean
from .sections import (
    OBJECTIVE_CONFIGS,
    EngineConfig,
    HumanlineConfig,
    ModelConfig,
    ObjectiveConfig,
    ParallelConfig,
    TrainConfig,
    _Section,
)
from .sections_data import DataConfig
from .sections_run import CheckpointConfig, ClusterConfig, EvalConfig, LoggingConfig, RolloutConfig


class Recipe(_Section):
    """One training run."""

    name: Optional[str] = Field(None, description="Run name; defaults to the recipe file name.")
    output_dir: str = Field(description="Where metrics.jsonl, checkpoints/ and final/ go.")
    model: ModelConfig
    data: DataConfig
    objective: ObjectiveConfig
    humanline: HumanlineConfig = Field(default_factory=HumanlineConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @field_validator("objective", mode="before")
    @classmethod
    def _objective_shorthand(cls, value):
        value = {"name": value} if isinstance(value, str) else value
        if isinstance(value, dict):
            name = value.get("name")
            if name is None:
                raise ValueError(f"`objective.name` is required: one of {', '.join(OBJECTIVE_CONFIGS)}")
            if name not in OBJECTIVE_CONFIGS:
                raise ValueError(
                    f"`objective.name: {name}` is not a known objective.{did_you_mean(str(name), OBJECTIVE_CONFIGS)} "
                    f"Choose one of: {', '.join(OBJECTIVE_CONFIGS)}"
                )
        return value
