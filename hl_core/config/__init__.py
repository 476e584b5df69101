"""The recipe schema: typed (pydantic v2), inheritable (``defaults:``), overridable (``a.b=c``).

A recipe is a YAML file whose top-level groups are ``model``, ``data``, ``objective``, ``humanline``,
``engine``, ``parallel``, ``train``, ``checkpoint``, ``eval``, ``logging``, ``rollout``, ``cluster`` and
``output_dir``. ``load_recipe(path, overrides)`` reads it with ``yaml.safe_load``, merges the files
named in its ``defaults:`` list (paths relative to the recipe; later files and the recipe itself win),
applies command-line overrides, and validates. Every mistake raises ``RecipeError`` with one paragraph
that names the key and the fix.

The package, by concern:

* ``sections.py`` / ``sections_run.py``: the groups (training; evaluation, logging, rollout, cluster);
  ``schema.py``: ``Recipe``, the top level;
* ``checks.py``: cross-field checks (``check_recipe``) and the batch layout for a world size;
* ``decisions.py``: the decisions that combine several sections (the reference mode, what the data splits hold, what
  generation reads; ``decide``: all at once), so that each component receives its own section and these answers,
  never the whole recipe;
* ``load.py``: YAML, ``defaults:`` inheritance, overrides and the wording of validation errors;
* ``keys_doc.py``: the generator of ``docs/recipe-keys.md`` (``python -m hl_core.config``).
"""

from pathlib import Path

from .checks import batch_layout, check_recipe, pipeline_microbatches
from .decisions import (
    DataPlan,
    Decisions,
    Sampling,
    data_plan,
    decide,
    held_out_reward,
    lookahead_blocker,
    needs_old_logps,
    reference_cache_fields,
    reference_mode,
    reference_model_needed,
    reference_needed,
    sampling,
)
from .keys_doc import recipe_keys_markdown
from .load import apply_overrides, deep_merge, load_recipe, parse_override, recipe_to_yaml, validate_recipe_dict
from .schema import Recipe
from .sections import (
    OBJECTIVE_CONFIGS,
    DPOObjective,
    EngineConfig,
    GRPOObjective,
    HumanlineConfig,
    KTOObjective,
    ModelConfig,
    ObjectiveConfig,
    ParallelConfig,
    SFTObjective,
    TrainConfig,
)
from .sections_data import DataConfig, DataSource, MixtureSource
from .sections_run import (
    POST_TRAINING_EVALS,
    AlpacaEvalConfig,
    CheckpointConfig,
    ClusterConfig,
    DataQualityEvalConfig,
    EvalConfig,
    LoggingConfig,
    Math500EvalConfig,
    RewardConfig,
    RolloutConfig,
    WandbConfig,
)

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

__all__ = [
    "REPO_ROOT", "Recipe", "load_recipe", "check_recipe", "batch_layout", "pipeline_microbatches", "recipe_to_yaml",
    "recipe_keys_markdown",
    "apply_overrides", "deep_merge", "parse_override", "validate_recipe_dict", "POST_TRAINING_EVALS",
    "OBJECTIVE_CONFIGS", "ObjectiveConfig", "DPOObjective", "KTOObjective", "GRPOObjective", "SFTObjective",
    "ModelConfig", "DataSource", "MixtureSource", "DataConfig", "HumanlineConfig", "EngineConfig", "ParallelConfig",
    "TrainConfig",
    "CheckpointConfig", "Math500EvalConfig", "AlpacaEvalConfig", "DataQualityEvalConfig", "EvalConfig",
    "WandbConfig", "LoggingConfig", "RewardConfig", "RolloutConfig", "ClusterConfig",
    "DataPlan", "Decisions", "Sampling", "data_plan", "decide", "held_out_reward", "lookahead_blocker",
    "needs_old_logps", "reference_cache_fields", "reference_mode", "reference_model_needed", "reference_needed",
    "sampling",
]
