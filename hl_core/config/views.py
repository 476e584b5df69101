"""Typed views of a recipe, each holding exactly what one whole-run component reads, so that none of them receives
the recipe itself:

* ``EngineSpec`` (``engine_spec``): what an engine builds and runs from (``hl_core.engines``);
* ``RunShape`` (``run_shape``): what ``--plan`` estimates, ``--rehearse`` rehearses and a checkpoint's run record
  keeps: the layout, the model, the data and the batches, and the reference's mode;
* ``Validation`` (``validation``): what ``--validate`` checks beyond the recipe's own checks, which it runs first.

Each view is built from the recipe as it is then (the trainer sets ``train.max_steps`` from ``train.epochs`` once the
data is read: it builds the engine's and the run record's views after that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .checks import batch_layout, check_recipe, pipeline_microbatches
from .decisions import DataPlan, data_plan, reference_mode, reference_model_needed
from .schema import Recipe
from .sections import EngineConfig, HumanlineConfig, ModelConfig, ParallelConfig, TrainConfig
from .sections_data import DataConfig
from .sections_run import CheckpointConfig, ClusterConfig, EvalConfig, RolloutConfig


# ------------------------------------------------------------------------------------------------ the engines
@dataclass(frozen=True)
class EngineSpec:
    """What an engine reads: its own section, the parallel layout, the model, the training settings, and from the
    other sections ``packing`` and ``max_length`` (``data.packing``: one forward over bins of ``data.max_length``
    tokens), ``reference_model`` (``reference_model_needed``: a second model to build) and ``syncs``
    (``humanline.sync_every`` is set: the reference moves, so checkpoints keep it)."""

    engine: EngineConfig
    parallel: ParallelConfig
    model: ModelConfig
    train: TrainConfig
    packing: bool
    max_length: int
    reference_model: bool
    syncs: bool

    def batch_layout(self, world_size: int) -> Tuple[int, int]:
        """``(data-parallel size, gradient accumulation steps)`` on ``world_size`` processes (``batch_layout``)."""
        return batch_layout(self.parallel, self.train, world_size)

    def pipeline_microbatches(self, rows: int) -> int:
        """Pipeline micro-batches per micro-batch of ``rows`` sequences (``pipeline_microbatches``)."""
        return pipeline_microbatches(self.parallel, rows)


def engine_spec(recipe: Recipe) -> EngineSpec:
    """The recipe's ``EngineSpec``."""
    return EngineSpec(recipe.engine, recipe.parallel, recipe.model, recipe.train, recipe.data.packing,
                      recipe.data.max_length, reference_model_needed(recipe), recipe.humanline.sync_every is not None)
# ------------------------------------------------------------------------------------------------ a run's shape
@dataclass(frozen=True)
class RunShape:
    """What ``--plan`` estimates (``hl_core.preflight.plan``), ``--rehearse`` rehearses (``hl_core.rehearsal``) and a
    checkpoint's run record keeps (``hl_core.loop.run_record``): the recipe's ``name``; the sections of the model,
    the data, the engine, the parallel layout, the training, the rollouts, the cluster and the evaluations (the LoRA
    check reads the post-training evaluations); the ``objective``'s name; ``humanline.sync_every``; and the reference's
    mode and the data's plan (``reference_mode``, ``data_plan``)."""

    name: str
    model: ModelConfig
    data: DataConfig
    engine: EngineConfig
    parallel: ParallelConfig
    train: TrainConfig
    rollout: RolloutConfig
    cluster: ClusterConfig
    eval: EvalConfig
    objective: str
    sync_every: Optional[int]
    reference_mode: Tuple[str, str]
    data_plan: DataPlan

    @property
    def world_size(self) -> int:
        """``cluster.nodes`` x ``cluster.gpus_per_node``."""
        return self.cluster.nodes * self.cluster.gpus_per_node

    def batch_layout(self, world_size: int) -> Tuple[int, int]:
        """``(data-parallel size, gradient accumulation steps)`` on ``world_size`` processes (``batch_layout``)."""
        return batch_layout(self.parallel, self.train, world_size)


def run_shape(recipe: Recipe) -> RunShape:
    """The recipe's ``RunShape``."""
    return RunShape(recipe.name, recipe.model, recipe.data, recipe.engine, recipe.parallel, recipe.train,
                    recipe.rollout, recipe.cluster, recipe.eval, recipe.objective.name, recipe.humanline.sync_every,
                    reference_mode(recipe), data_plan(recipe))


# ------------------------------------------------------------------------------------------------ --validate
@dataclass(frozen=True)
class Validation:
    """What ``--validate`` (``hl_core.preflight.validate``) checks once the recipe's own checks passed: the run's
    shape on ``world_size`` processes, where it writes (``output_dir``, the ``checkpoint`` section: another run's
    outputs, the checkpoint to resume and its run record) and the ``humanline`` section its report names."""

    shape: RunShape
    world_size: int
    output_dir: str
    checkpoint: CheckpointConfig
    humanline: HumanlineConfig


def validation(recipe: Recipe, world_size: Optional[int] = None) -> Validation:
    """The recipe's own checks for ``world_size`` processes (default: ``cluster.nodes`` x ``cluster.gpus_per_node``;
    ``check_recipe``: a ``RecipeError`` naming the key and the fix), then its ``Validation``."""
    world = world_size or recipe.cluster.nodes * recipe.cluster.gpus_per_node
    check_recipe(recipe, world)
    return Validation(run_shape(recipe), world, recipe.output_dir, recipe.checkpoint, recipe.humanline)
