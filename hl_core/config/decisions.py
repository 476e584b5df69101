"""Decisions that combine several sections of a recipe, made here so that no component reads the whole recipe.

The trainer asks them all at once (``decide``: a ``Decisions``) and hands each component its answer beside its own
section; ``--plan``, ``--validate`` and the engines' builder ask the ones they need:

* the reference: whether anything reads it (``reference_needed``), where its log-probs come from
  (``reference_mode``: ``none``, ``cached``, ``lookahead`` or ``copy``), why look-ahead syncing cannot serve a run
  (``lookahead_blocker``), and the recipe keys a cached reference's log-probs depend on (``reference_cache_fields``);
* rollouts: whether the objective's ratio is against the behaviour policy's log-probs (``needs_old_logps``), and
  what generation reads (``Sampling``, ``sampling``);
* the data: what each split holds (``DataPlan``, ``data_plan``; ``held_out_reward``).

None of them depends on the run's length (``train.max_steps``, which ``train.epochs`` sets once the data is read),
so they are decided before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from ..objectives import OBJECTIVES
from ..storage.digests import local_files
from .schema import Recipe
from .sections import ModelConfig
from .sections_run import RolloutConfig


# ------------------------------------------------------------------------------------------------ the reference
def needs_old_logps(recipe: Recipe) -> bool:
    """Rollouts: whether the objective's ratio is against the behaviour policy's log-probs, kept at sampling
    time (standard GRPO); humanline GRPO takes the ratio against the synced reference instead."""
    return OBJECTIVES[recipe.objective.name].uses_behaviour_logps and not recipe.humanline.enabled


def reference_needed(recipe: Recipe) -> bool:
    """Whether anything reads the reference's log-probs, and so whether the engine builds a reference model.

    Not for SFT or a reference-free DPO loss (SimPO), and not for standard rollout GRPO without a KL term: its ratio
    is against the behaviour policy's log-probs kept at sampling time. Syncing implies humanline, which always needs
    the reference (the checks refuse humanline with a reference-free objective).
    """
    if not OBJECTIVES[recipe.objective.name].needs_reference(recipe.objective):
        return False
    behaviour_ratio_only = recipe.rollout.every is not None and needs_old_logps(recipe)
    return not (behaviour_ratio_only and getattr(recipe.objective, "beta_kl", 0.0) == 0)


def lookahead_blocker(recipe: Recipe) -> Optional[str]:
    """Why look-ahead syncing cannot serve this run's reference log-probs (None when it can)."""
    if recipe.humanline.sync_mix != 1.0:
        return (f"`humanline.sync_mix: {recipe.humanline.sync_mix}` mixes the policy into the reference, and the "
                "policy computing log-probs ahead holds its own weights, not the mixture")
    if recipe.rollout.every is not None:
        return ("its batches are rollouts (`rollout.every`), sampled after the sync from the updated policy, so "
                "they are not known at the sync")
    if recipe.train.on_nonfinite == "skip":
        return ("`train.on_nonfinite: skip`: a skipped update does not sync, and the reference it keeps is one "
                "whose log-probs were not computed ahead")
    return None


def reference_mode(recipe: Recipe) -> Tuple[str, str]:
    """Where the reference's log-probs come from, and why: ``none`` (nothing reads them), ``cached`` (frozen,
    precomputed once: ``train.cache_reference_logps``), ``lookahead`` (synced, computed by the policy at each
    sync for the batches up to the next: ``humanline.reference``) or ``copy`` (a second model)."""
    if not reference_needed(recipe):
        return "none", "nothing reads the reference's log-probs"
    if recipe.train.cache_reference_logps:
        return "cached", "frozen reference, log-probs precomputed once (`train.cache_reference_logps`)"
    if recipe.humanline.sync_every is None:
        return "copy", "frozen reference kept as a second model (`train.cache_reference_logps: true` drops it)"
    if recipe.humanline.reference == "copy":
        return "copy", "`humanline.reference: copy`"
    blocker = lookahead_blocker(recipe)
    if blocker is not None:
        return "copy", f"look-ahead syncing does not apply: {blocker}"
    return "lookahead", "offline data: each sync computes the log-probs of the batches up to the next sync"


def reference_model_needed(recipe: Recipe) -> bool:
    """Whether the engine builds a second (reference) model."""
    return reference_mode(recipe)[0] == "copy"


def reference_cache_fields(recipe: Recipe) -> Dict[str, object]:
    """The recipe's part of a cached reference's fingerprint (``hl_core.reference.cache.fingerprint`` adds the
    format, the temperature and the engine's batch layout): the model section and the content of a local model
    directory's files, the data section and the content of its local files, the objective, precision and parallel
    layout, the seed, micro-batch and chunking, and the evaluation settings; not the number of updates (part files
    cover fixed update ranges). Flat ``{field: value}``, JSON-serialisable."""
    data, train = recipe.data, recipe.train
    fields: Dict[str, object] = {f"model.{key}": value for key, value in recipe.model.model_dump(mode="json").items()}
    for name, digest in local_files(recipe.model.name_or_path).items():
        fields[f"model file {name}"] = digest
    if recipe.model.tokenizer:
        for name, digest in local_files(recipe.model.tokenizer).items():
            fields[f"tokenizer file {name}"] = digest
    for key, value in data.model_dump(mode="json").items():
        fields[f"data.{key}"] = value
    sources = [("train" if not data.mixture else f"train[{i}]", source) for i, source in enumerate(data.train_sources)]
    for split, source in sources + [("eval", data.eval)]:
        for name, digest in local_files(source.path if source is not None else None).items():
            fields[f"data.{split} file {name}"] = digest
    fields.update({
        "objective.name": recipe.objective.name, "engine.name": recipe.engine.name,
        "engine.precision": recipe.engine.precision, "parallel.tp": recipe.parallel.tp,
        "parallel.pp": recipe.parallel.pp, "train.seed": train.seed, "train.micro_batch_size": train.micro_batch_size,
        "train.logps_chunk_tokens": train.logps_chunk_tokens, "eval.every": recipe.eval.every,
        "eval.batch_size": recipe.eval.batch_size, "eval.max_batches": recipe.eval.max_batches,
    })
    return fields


# ------------------------------------------------------------------------------------------------ rollouts
@dataclass(frozen=True)
class Sampling:
    """What generation reads (``hl_core.rollout.generation.build_sampler``, the rollout source, the held-out
    evaluation). More than the ``rollout`` section, because vLLM loads its own copy of the policy: ``model`` names
    it (path, tokenizer, config overrides, random init), ``vllm_dtype`` is the dtype it loads in
    (``rollout.vllm.dtype``; ``auto``: float32 for an fp32 run, else bfloat16); and prompts' seeds start from
    ``seed`` (``rollout.seed``, else ``train.seed``)."""

    rollout: RolloutConfig
    seed: int
    model: ModelConfig
    vllm_dtype: str


def sampling(recipe: Recipe) -> Sampling:
    """The recipe's ``Sampling``."""
    rollout = recipe.rollout
    dtype = rollout.vllm.dtype
    if dtype == "auto":
        dtype = "float32" if recipe.engine.precision == "fp32" else "bfloat16"
    seed = rollout.seed if rollout.seed is not None else recipe.train.seed
    return Sampling(rollout, seed, recipe.model, dtype)


# ------------------------------------------------------------------------------------------------ the data
@dataclass(frozen=True)
class DataPlan:
    """What a run asks of its data, read from the recipe once by `data_plan`; the builders of ``hl_core.data.build``
    take this and the recipe's ``data`` section, nothing else."""

    train_kind: str  # what the train split holds: a key of DATA_KINDS (prompts when rollouts write completions)
    eval_kind: str  # what the eval split holds (prompts when evaluations are by reward)
    example_kind: str  # the objective's examples; their collate batches generated examples too
    seed: int  # `train.seed`: the `data.eval_fraction` split
    system_prompt: Optional[str] = None  # `rollout.system_prompt`, for prompts
    token_budget: Optional[int] = None  # `train.max_tokens_per_micro_batch`, named in the data line


def data_plan(recipe: Recipe) -> DataPlan:
    """The recipe's objective, rollouts, held-out evaluation and seed, as far as the data depend on them."""
    example = OBJECTIVES[recipe.objective.name].data_kind
    train = "prompts" if recipe.rollout.every is not None else example
    return DataPlan(train_kind=train, eval_kind="prompts" if held_out_reward(recipe) else train, example_kind=example,
                    seed=recipe.train.seed, system_prompt=recipe.rollout.system_prompt,
                    token_budget=recipe.train.max_tokens_per_micro_batch)


def held_out_reward(recipe: Recipe) -> bool:
    """True when held-out evaluations sample and score completions (``eval.held_out``; auto: with rollouts)."""
    mode = recipe.eval.held_out
    return mode == "reward" or (mode == "auto" and recipe.rollout.every is not None)


# ------------------------------------------------------------------------------------------------ all at once
@dataclass(frozen=True)
class Decisions:
    """The answers above for one recipe (``decide``), as the trainer hands them out."""

    data: DataPlan
    held_out_reward: bool
    sampling: Sampling
    needs_old_logps: bool
    reference_mode: Tuple[str, str]  # (mode, why)


def decide(recipe: Recipe) -> Decisions:
    """Every decision of this module for ``recipe`` but ``reference_cache_fields`` (it hashes the model's and the
    data's files: asked only when the reference is cached)."""
    return Decisions(data_plan(recipe), held_out_reward(recipe), sampling(recipe), needs_old_logps(recipe),
                     reference_mode(recipe))
