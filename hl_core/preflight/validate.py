"""``run.py --validate``: everything that can be checked without the weights or a GPU.

The schema was checked on load; here: the launcher's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``: the run would refuse them at its start), the cross-field checks (``check_recipe``:
data and model paths,
``output_dir``, the checkpoint to resume), the checkpoint's run record against the recipe and another run's outputs
in ``output_dir`` (``hl_core/loop``), the parallel layout for the world size, the speed switches against the model
family and the machine (``model.kernels: liger`` needs a CUDA GPU), the local model directory's config
(``model.config_overrides``, custom code without ``model.trust_remote_code``) and weight files (their headers: a cut
or damaged safetensors file, a missing shard), the local
tokenizer (its files, its size against the model's vocabulary), and the local data rows; when the tokenizer
is local, the rows are also tokenized, reporting what ``data.max_length`` truncates and the identical pairs
that training would drop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..callbacks import build_callbacks
from ..config import batch_layout, check_recipe, data_plan
from ..data.build import build_datasets, describe_data, load_split_records
from ..engines.base import check_launch_environment
from ..loop.lifecycle import check_other_run
from ..loop.run_record import check_resume_record, run_record
from ..loop.sources import epoch_steps
from ..models.loading import check_model_config, check_weights_load, load_tokenizer
from ..models.specs import check_layout
from ..models.speed import check_speed_options
from ..storage import gguf_models
from ..storage.checkpoints import resume_target


def validate_recipe(recipe, world_size: Optional[int] = None) -> str:
    """The report printed by ``--validate``; every problem raises a ``UserError`` (one paragraph, exit 2)."""
    world = world_size or recipe.cluster.nodes * recipe.cluster.gpus_per_node
    check_recipe(recipe, world)
    # RANK=abc, RANK >= WORLD_SIZE, ...: what training refuses at its start, after the recipe's checks as there
    check_launch_environment()
    check_layout(recipe, world)
    model = gguf_models.converted_model(recipe.model)  # a gguf: model: its converted directory if any (no converting)
    check_model_config(model)
    check_weights_load(model)  # a local model's config.json and safetensors headers (no weights read)
    target, _ = resume_target(recipe.checkpoint.resume, recipe.output_dir)
    check_other_run(Path(recipe.output_dir), recipe.checkpoint, target)  # another run's outputs in output_dir
    resume = (check_resume_record(target, recipe.checkpoint.resume, run_record(recipe, world)) if target is not None
              else None)
    check_speed_options(recipe)  # model.kernels and train.fused_logprobs against the model family and this machine
    build_callbacks(recipe.train.callbacks)  # train.callbacks: importable, built, LoopCallbacks
    tokenizer = None
    if Path(model.tokenizer or model.name_or_path).expanduser().is_dir():
        tokenizer = load_tokenizer(model)  # local: its files and its size against the model's vocabulary
    lines = [f"recipe `{recipe.name}` is valid"]
    if resume is not None:
        lines += [f"resumes `{target}`"] + resume.notices
    sources = recipe.data.train_sources + ([recipe.data.eval] if recipe.data.eval else [])
    if all(s.path is not None for s in sources):
        plan = data_plan(recipe)
        records = load_split_records(recipe.data, plan)
        train_parts, evaluation = records
        lines.append(f"data: {sum(map(len, train_parts))} train rows"
                     + (f" ({', '.join(str(len(p)) for p in train_parts)} per source)" if recipe.data.mixture else "")
                     + (f", {len(evaluation)} eval rows" if evaluation else "") + " checked")
        if tokenizer is None and gguf_models.is_gguf_reference(model.tokenizer or model.name_or_path):
            lines.append("tokenizer: inside the GGUF file, not converted yet: the rows are tokenized when training "
                         "converts it (or run --validate again after that)")
        if tokenizer is not None:
            tokenized = build_datasets(recipe.data, plan, tokenizer, show_progress=False, records=records)
            lines.append("tokenized: " + describe_data(recipe.data, plan, *tokenized))
            if recipe.train.epochs is not None:  # what the run will derive: the same examples, the same layout
                lines.append(epoch_steps(recipe.train, len(tokenized[0]), *batch_layout(recipe, world))[1])
    else:
        lines.append("data: Hugging Face dataset(s) named; rows are checked when loaded at run time")
    hl = recipe.humanline
    lines.append(
        f"objective {recipe.objective.name}, transform {hl.transform}"
        + (f" [{hl.log_eps_P}, {hl.log_eps_R}]" if hl.transform == "clip" else "")
        + f", sync_every {hl.sync_every}, engine {recipe.engine.name} ZeRO-{recipe.engine.zero_stage} "
          f"{recipe.engine.precision}"
    )
    return "\n".join(lines)
