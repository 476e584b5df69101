"""The recipe schema: typed (pydantic v2), inheritable (``defaults:``), overridable (``a.b=c``).

A recipe is a YAML file whose top-level groups are ``model``, ``data``, ``objective``, ``humanline``,
``engine``, ``parallel``, ``train``, ``checkpoint``, ``eval``, ``logging``, ``rollout``, ``cluster`` and
``output_dir``. ``load_recipe(path, overrides)`` reads it with ``yaml.safe_load``, merges the files
named in its ``defaults:`` list (paths relative to the recipe; later files and the recipe itself win),
applies command-line overrides, and validates. Every mistake raises ``RecipeError`` with one paragraph
that names the key and the fix.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Annotated, Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import RecipeError, did_you_mean

REPO_ROOT = Path(__file__).resolve().parent.parent


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# ------------------------------------------------------------------------------------------------
# Groups
# ------------------------------------------------------------------------------------------------


class ModelConfig(_Section):
    """The policy model (the reference starts as a copy of it) and its tokenizer."""

    name_or_path: str = Field(
        description="Hugging Face model name or local directory (config.json [+ weights] + tokenizer)."
    )
    tokenizer: Optional[str] = Field(None, description="Tokenizer name or directory; defaults to `name_or_path`.")
    random_init: bool = Field(
        False,
        description="Build the model from its config.json with random weights (seeded by `train.seed`) "
        "instead of loading weights; for tests and the CPU demo.",
    )
    trust_remote_code: bool = Field(
        False, description="Allow custom modelling code from the model repository. Off unless you trust it."
    )
    attn_implementation: Optional[str] = Field(
        "sdpa", description="transformers attention backend: `eager`, `sdpa` or `flash_attention_2`."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    config_overrides: Dict[str, Any] = Field(
        default_factory=dict,
        description="Values set on the model's config before building it, e.g. `{hidden_size: 256}` with "
        "`random_init` for a larger benchmark model, or `{attention_dropout: 0.0}`.",
    )


class DataSource(_Section):
    """One data source: a local file (`path`) or a Hugging Face dataset (`name`)."""

    path: Optional[str] = Field(None, description="Local `.jsonl`, `.json` or `.parquet` file.")
    name: Optional[str] = Field(None, description="Hugging Face dataset name (used when `path` is not set).")
    split: str = Field("train", description="Split to read from a Hugging Face dataset.")
    config: Optional[str] = Field(None, description="Hugging Face dataset configuration name.")
    limit: Optional[int] = Field(None, ge=1, description="Use only the first `limit` rows.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.name is None):
            raise ValueError("set exactly one of `path` (a local file) or `name` (a Hugging Face dataset)")
        return self


class DataConfig(_Section):
    """Training and held-out data, row format, chat template and truncation."""

    train: DataSource = Field(description="Training data source.")
    eval: Optional[DataSource] = Field(None, description="Held-out data source for `eval.every`.")
    eval_fraction: float = Field(
        0.0, ge=0.0, lt=1.0, description="Hold out this fraction of `train` for evaluation when `eval` is unset."
    )
    format: Literal["auto", "plain", "messages"] = Field(
        "auto",
        description="Row format: `plain` (prompt/chosen/rejected strings), `messages` (chosen/rejected as "
        "chat message lists, UltraFeedback style) or `auto` (detected per row).",
    )
    max_length: int = Field(1024, ge=8, description="Maximum prompt + completion tokens per sequence.")
    max_prompt_length: int = Field(512, ge=1, description="Prompt tokens kept (the most recent) when truncating.")
    chat_template: str = Field(
        "auto", description="`auto` (the tokenizer's chat template), `none` (contents joined by blank lines), "
        "`raw` (contents concatenated as they are), or a Jinja template string."
    )
    shuffle: bool = Field(True, description="Shuffle training data each epoch (seeded by `train.seed`).")

    @model_validator(mode="after")
    def _lengths(self):
        if self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"`max_prompt_length` ({self.max_prompt_length}) must be smaller than `max_length` "
                f"({self.max_length}) so the completion keeps at least one token"
            )
        return self


class DPOObjective(_Section):
    """DPO: `-logsigmoid(beta * (sum_t d_chosen - sum_t d_rejected))`; consumes preference pairs."""

    name: Literal["dpo"] = Field(description="`dpo`.")
    beta: float = Field(0.1, gt=0, description="Inverse temperature on the summed log-ratio reward.")


class KTOObjective(_Section):
    """KTO: `w_D (1 - sigmoid(beta (r - z0)))` / `w_U (1 - sigmoid(beta (z0 - r)))`; consumes labelled completions
    (preference pairs are split into one desirable and one undesirable example)."""

    name: Literal["kto"] = Field(description="`kto`.")
    beta: float = Field(0.1, gt=0, description="Inverse temperature on the summed log-ratio reward.")
    desirable_weight: float = Field(1.0, gt=0, description="w_D, weight of desirable examples.")
    undesirable_weight: float = Field(1.0, gt=0, description="w_U, weight of undesirable examples.")


class GRPOObjective(_Section):
    """GRPO: clipped surrogate with group-normalised advantages and an optional k3 KL term; consumes
    prompt groups with scores (preference pairs become groups of two)."""

    name: Literal["grpo"] = Field(description="`grpo`.")
    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip: ratio floor `1 - eps_low`.")
    eps_high: float = Field(0.2, ge=0, description="PPO clip: ratio ceiling `1 + eps_high`.")
    beta_kl: float = Field(
        0.0, ge=0,
        description="Weight of the k3 KL penalty against the reference (MATH: 1e-4). At 0, standard rollout GRPO "
        "(ratio against the behaviour policy) builds no reference model.",
    )
    aggregation: Literal["token", "sequence"] = Field(
        "token", description="`token`: sum over completion tokens / their count; `sequence`: mean of per-sequence means."
    )
    advantage_eps: float = Field(1e-4, gt=0, description="`eps` in `(score - mean) / (std + eps)`.")


class SFTObjective(_Section):
    """SFT: mean negative log-likelihood of the completion tokens (warm-up runs); no reference, no humanline."""

    name: Literal["sft"] = Field(description="`sft`.")


OBJECTIVE_CONFIGS = {"dpo": DPOObjective, "kto": KTOObjective, "grpo": GRPOObjective, "sft": SFTObjective}
ObjectiveConfig = Annotated[
    Union[DPOObjective, KTOObjective, GRPOObjective, SFTObjective], Field(discriminator="name")
]


class HumanlineConfig(_Section):
    """Humanline: per-token log-ratio transform (clip/sample/none) and reference syncing."""

    transform: str = Field(
        "none",
        description="Per-token log-ratio transform: `clip` (asymmetric clamp), `sample` (token rejection) "
        "or `none` (plain objective).",
    )
    sync_every: Optional[int] = Field(
        None, ge=1, description="Overwrite the reference with the policy every k optimizer updates; null = never."
    )
    log_eps_P: float = Field(-1.5, le=0, description="Lower clip bound on the per-token log-ratio (<= 0).")
    log_eps_R: float = Field(1.5, ge=0, description="Upper clip bound on the per-token log-ratio (>= 0).")
    gamma_P: float = Field(0.5, gt=0, description="Beta(gamma_P, beta_P) draw for the policy-side rejection test.")
    gamma_R: float = Field(0.01, gt=0, description="Beta(gamma_R, beta_R) draw for the reference-side rejection test.")
    beta_P: float = Field(1.0, gt=0, description="Second Beta parameter of the policy-side test.")
    beta_R: float = Field(1.0, gt=0, description="Second Beta parameter of the reference-side test.")

    @field_validator("transform")
    @classmethod
    def _known(cls, transform):
        from .humanline import transform_names

        names = transform_names()
        if transform not in names:
            raise ValueError(
                f"unknown transform `{transform}`.{did_you_mean(transform, names)} Choose one of: {', '.join(names)}"
            )
        return transform

    @property
    def enabled(self) -> bool:
        return self.transform != "none" or self.sync_every is not None


class EngineConfig(_Section):
    """The training engine and its precision/sharding settings."""

    name: Literal["deepspeed", "megatron"] = Field("deepspeed", description="Training engine.")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="DeepSpeed ZeRO stage (0-3). The Megatron engine shards by `parallel` instead (set 0 there)."
    )
    precision: Literal["fp32", "bf16"] = Field("bf16", description="Parameter/compute precision.")
    zero3_param_persistence_threshold: int = Field(
        100000, ge=0, description="ZeRO-3: parameters with fewer elements stay whole on every rank."
    )
    dist_backend: Optional[Literal["nccl", "gloo"]] = Field(
        None, description="torch.distributed backend; default nccl on GPU, gloo on CPU."
    )


class ParallelConfig(_Section):
    """Model-parallel layout (data-parallel size = world size / (tp x pp))."""

    tp: int = Field(1, ge=1, description="Tensor-parallel size (Megatron engine).")
    pp: int = Field(1, ge=1, description="Pipeline-parallel size (Megatron engine).")
    pipeline_microbatches: Optional[int] = Field(
        None, ge=1, description="Megatron pp > 1: pipeline micro-batches per micro-batch (default: up to 2 x pp)."
    )


class TrainConfig(_Section):
    """Optimisation: steps, learning rate, batch sizes, clipping, seed."""

    max_steps: int = Field(ge=1, description="Number of optimizer updates.")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate (AdamW).")
    micro_batch_size: int = Field(1, ge=1, description="Examples (pairs for DPO) per rank per forward/backward.")
    gradient_accumulation_steps: Optional[int] = Field(
        None, ge=1, description="Micro-batches per optimizer update; derived from `global_batch_size` when unset."
    )
    global_batch_size: Optional[int] = Field(
        None, ge=1, description="Examples per optimizer update over all ranks (micro x accumulation x data-parallel)."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to `lr`.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate shape after warm-up."
    )
    max_grad_norm: Optional[float] = Field(1.0, gt=0, description="Gradient-norm clip; null disables it.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: Tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    seed: int = Field(42, description="Seed for model init, data order and sampling.")
    deterministic: bool = Field(
        False, description="`torch.use_deterministic_algorithms(True)`: bit-repeatable runs (the reproduction "
        "study sets it), at some speed cost on GPU.",
    )
    num_threads: Optional[int] = Field(
        None, ge=1, description="CPU threads per process (`torch.set_num_threads`); null = torch's default.",
    )
    stop_after: Optional[int] = Field(
        None, ge=1,
        description="Stop this invocation after N updates with a resumable checkpoint (time-boxed jobs); "
        "rerun with `checkpoint.resume: auto` to continue.",
    )
    cache_reference_logps: bool = Field(
        False, description="Precompute reference log-probs once (only valid with a frozen reference)."
    )
    logps_chunk_size: int = Field(128, ge=1, description="Sequence chunk for the float32 log-softmax.")

    @model_validator(mode="after")
    def _batch(self):
        if self.global_batch_size is not None and self.gradient_accumulation_steps is not None:
            raise ValueError("set either `gradient_accumulation_steps` or `global_batch_size`, not both")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"`global_batch_size` ({self.global_batch_size}) must be a multiple of `micro_batch_size` "
                f"({self.micro_batch_size})"
            )
        return self


class CheckpointConfig(_Section):
    """Resumable checkpoints and the final Hugging Face export."""

    save_every: Optional[int] = Field(None, ge=1, description="Save a resumable checkpoint every N updates.")
    keep_last: int = Field(2, ge=1, description="Resumable checkpoints kept on disk.")
    resume: str = Field("auto", description="`auto` (latest checkpoint in output_dir if any), `never`, or a path.")
    save_final: bool = Field(True, description="Write `final/`, a Hugging Face model directory, at the end.")


class _GenerationEval(_Section):
    backend: Literal["auto", "hf", "vllm"] = Field("auto", description="auto = vllm when installed with a GPU, else hf.")
    chat_template: Union[Literal["auto"], bool] = Field("auto", description="Use the model's chat template (auto: when it has one).")
    batch_size: int = Field(8, ge=1, description="Generation batch size (hf backend).")
    limit: Optional[int] = Field(None, ge=1, description="Evaluate only the first N items.")
    seed: int = Field(0, description="Sampling seed.")
    dtype: str = Field("auto", description="Model dtype for generation: auto | float32 | bfloat16 | float16.")


class Math500EvalConfig(_GenerationEval):
    """MATH-500 pass@1 through lm-eval (task `hl_math500`), scored with math-verify."""

    enabled: bool = Field(False, description="Run MATH-500 after training.")
    data: Optional[str] = Field(
        None, description="Local .jsonl/.json/.parquet in the MATH-500 schema, or a HF dataset name; null = `HuggingFaceH4/MATH-500`."
    )
    split: str = Field("test", description="Split of a HF dataset.")
    n_samples: int = Field(1, ge=1, description="Samples per problem; pass@1 is their mean, pass@1_std their std.")
    temperature: float = Field(0.6, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling.")
    max_new_tokens: int = Field(2048, ge=1, description="Generation budget per sample.")
    prompt: Literal["r1", "boxed", "minerva"] = Field(
        "r1", description="r1: the paper's <think>/<answer> system prompt; boxed: 'put your final answer within "
        "\\boxed{}'; minerva: 'Problem:/Solution:' for base models."
    )


class AlpacaEvalConfig(_GenerationEval):
    """AlpacaEval: generate, judge with the alpaca_eval package, win rate (+ length-controlled when possible)."""

    enabled: bool = Field(False, description="Run AlpacaEval after training.")
    data: Optional[str] = Field(
        None, description="Local JSON/JSONL (instruction, output = reference output, generator, dataset); null = hub `tatsu-lab/alpaca_eval`."
    )
    hub_config: str = Field("alpaca_eval_gpt4_baseline", description="Hub file/config with the instructions + reference outputs.")
    reference_outputs: Optional[str] = Field(None, description="Separate file of reference outputs (by instruction).")
    judge: str = Field(
        "api:weighted_alpaca_eval_gpt-4.1",
        description="api:NAME (alpaca_eval annotator config; needs OPENAI_API_KEY), rm:MODEL (a reward model such as "
        "ArmoRM) or py:MODULE:FUNCTION (a callable).",
    )
    rm_mode: Literal["hard", "soft"] = Field("hard", description="Reward-model preference: higher reward wins, or 1 + sigmoid(dr).")
    rm_batch_size: int = Field(8, ge=1, description="Reward-model scoring batch size.")
    trust_remote_code: bool = Field(False, description="Allow the judge model's custom code (ArmoRM needs it).")
    length_controlled: Literal["auto", "off"] = Field("auto", description="Compute the LC win rate when its GLM inputs exist.")
    lc_data: Optional[str] = Field(None, description="Local copy of alpaca_eval's df_gamed.csv (else hub/cache).")
    max_new_tokens: int = Field(2048, ge=1, description="Generation budget.")
    temperature: float = Field(0.7, ge=0, description="Sampling temperature (the authors' HALOs sampler default).")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling.")


class DataQualityEvalConfig(_Section):
    """The paper's data-quality proxy: mean per-token log-prob of the offline completions under the reference."""

    enabled: bool = Field(False, description="Compute the data-quality proxy after training.")
    data: Optional[str] = Field(None, description="Local file or HF name; null = the recipe's `data.train` source.")
    model: Optional[str] = Field(
        None, description="Reference model directory; null = the recipe's `model:` (the initial policy, rebuilt with "
        "`train.seed` when `model.random_init`)."
    )
    split: str = Field("train", description="Split of a HF dataset (when `data` is set).")
    limit: Optional[int] = Field(None, ge=1, description="Score only the first N rows.")
    batch_size: int = Field(8, ge=1, description="Scoring batch size.")


class EvalConfig(_Section):
    """Held-out evaluation during training, and the post-training evaluations (MATH-500, AlpacaEval, data quality)."""

    every: Optional[int] = Field(None, ge=1, description="Held-out evaluation every N updates; null = never.")
    at_start: bool = Field(True, description="Also evaluate before the first update (when `every` is set).")
    batch_size: Optional[int] = Field(None, ge=1, description="Eval micro-batch; defaults to train.micro_batch_size.")
    max_batches: Optional[int] = Field(None, ge=1, description="Cap on eval batches per evaluation.")
    after_training: bool = Field(
        True, description="Run the enabled post-training evals (math500 / alpaca_eval / data_quality) on `final/` "
        "when training finishes (rank 0)."
    )
    output_subdir: str = Field("eval", description="Post-training results go to `output_dir/<output_subdir>/*.json`.")
    offline: bool = Field(False, description="Never touch the Hugging Face hub in the post-training evals.")
    math500: Math500EvalConfig = Field(default_factory=Math500EvalConfig, description="MATH-500 pass@1.")
    alpaca_eval: AlpacaEvalConfig = Field(default_factory=AlpacaEvalConfig, description="AlpacaEval win rates.")
    data_quality: DataQualityEvalConfig = Field(default_factory=DataQualityEvalConfig, description="Data-quality proxy.")


POST_TRAINING_EVALS = ("math500", "alpaca_eval", "data_quality")


class WandbConfig(_Section):
    """Weights & Biases sink."""

    enabled: bool = Field(False, description="Log to Weights & Biases.")
    project: str = Field("humanline", description="W&B project.")
    entity: Optional[str] = Field(None, description="W&B entity (team).")
    run_name: Optional[str] = Field(None, description="W&B run name; defaults to the recipe name.")
    mode: Literal["online", "offline", "disabled"] = Field("online", description="W&B mode.")


class LoggingConfig(_Section):
    """Progress bar, console lines and metric sinks (metrics.jsonl always)."""

    log_every: int = Field(1, ge=1, description="Print a metrics line every N updates (metrics.jsonl gets all).")
    progress_bar: bool = Field(True, description="tqdm progress bar on rank 0.")
    tensorboard: bool = Field(False, description="Write TensorBoard events to output_dir/tensorboard.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases sink.")


class RewardConfig(_Section):
    """How rollouts are scored."""

    kind: Literal["math", "reward_model", "callable"] = Field(
        "math", description="`math` (math-verify against the reference answer), `reward_model` (a sequence "
        "classifier such as ArmoRM) or `callable` (`function`)."
    )
    accuracy_weight: float = Field(1.0, description="math: weight of a correct final answer (the MATH runs used 8).")
    format_weight: float = Field(0.0, description="math: weight of the `<think>...</think><answer>...</answer>` format.")
    model: Optional[str] = Field(None, description="reward_model: model name or directory.")
    trust_remote_code: bool = Field(False, description="reward_model: allow its custom code (ArmoRM needs it).")
    batch_size: int = Field(16, ge=1, description="reward_model: sequences per scoring batch.")
    score_index: int = Field(0, ge=0, description="reward_model: logit used as the score (when no `.score` output).")
    function: Optional[str] = Field(
        None, description="callable: `package.module:function(prompts, completions, references) -> list[float]`."
    )


class RolloutConfig(_Section):
    """Generation inside the training loop (online / sparse); null = offline data only."""

    every: Optional[int] = Field(
        None, ge=1,
        description="Generate completions every N updates for the next N updates (1 = online, 64 = the paper's "
        "sparse setting); null = offline data only. With rollouts, `data.train` holds prompts and "
        "`train.micro_batch_size` counts prompts.",
    )
    backend: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="`hf` (transformers generate), `vllm` (GPU, when installed), `auto` (vllm when usable, else hf)."
    )
    num_generations: int = Field(8, ge=2, description="Completions per prompt (a GRPO group / the best-vs-worst pool).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (GRPO log-probs use it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_new_tokens: int = Field(256, ge=1, description="Generation length cap.")
    stop: List[str] = Field(default_factory=list, description="Stop strings (in addition to EOS).")
    threshold: float = Field(
        0.01, ge=0, description="Online DPO/KTO: keep a prompt's best-vs-worst pair only when their scores differ by more."
    )
    system_prompt: Optional[str] = Field(None, description="System message put before every prompt.")
    seed: Optional[int] = Field(None, description="Sampling seed; defaults to `train.seed`.")
    log_samples: bool = Field(
        False, description="Append every generated group (prompt, completions, scores) to "
        "`output_dir/rollouts/rank<R>.jsonl`.",
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How completions are scored.")


class ClusterConfig(_Section):
    """SLURM cluster settings used by the launchers."""

    nodes: int = Field(1, ge=1, description="SLURM nodes.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node.")
    partition: Optional[str] = Field(None, description="SLURM partition.")
    time: Optional[str] = Field(None, description="SLURM time limit, e.g. `24:00:00`.")
    gpu_memory_gb: float = Field(80.0, gt=0, description="Memory of one GPU, for `--plan` warnings.")
    container: Optional[str] = Field(None, description="Container image for the SLURM job.")


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


# ------------------------------------------------------------------------------------------------
# Cross-field checks (each names the keys involved and the fix)
# ------------------------------------------------------------------------------------------------


def check_recipe(recipe: Recipe, world_size: Optional[int] = None) -> None:
    """Incompatible settings raise ``RecipeError``; ``world_size`` enables the batch-layout checks."""
    hl = recipe.humanline
    if hl.sync_every is not None and recipe.train.cache_reference_logps:
        raise RecipeError(
            "`train.cache_reference_logps: true` cannot be combined with `humanline.sync_every` "
            f"({hl.sync_every}): syncing changes the reference, so cached reference log-probs go stale. "
            "Fix: set `train.cache_reference_logps=false`, or `humanline.sync_every=null` for a frozen reference."
        )
    if recipe.engine.name == "megatron":
        import importlib.util

        if importlib.util.find_spec("megatron.core") is None:
            raise RecipeError(
                "`engine.name: megatron` needs the `megatron-core` package. "
                "Fix: `pip install -e .[megatron]`, or use `engine.name=deepspeed`."
            )
    if recipe.objective.name == "sft" and (hl.enabled or recipe.rollout.every is not None):
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
    if recipe.engine.name == "deepspeed" and (recipe.parallel.tp > 1 or recipe.parallel.pp > 1):
        raise RecipeError(
            f"`parallel.tp={recipe.parallel.tp}`, `parallel.pp={recipe.parallel.pp}` need `engine.name: megatron`; "
            "the DeepSpeed engine is data-parallel only. Fix: set `parallel.tp=1 parallel.pp=1`, or switch engines."
        )
    reward = recipe.rollout.reward
    if recipe.rollout.every is not None:
        if reward.kind == "reward_model" and not reward.model:
            raise RecipeError(
                "`rollout.reward.kind: reward_model` needs `rollout.reward.model` (a sequence-classification model "
                "name or directory). Fix: set it, or use `rollout.reward.kind=math`."
            )
        if reward.kind == "callable" and not reward.function:
            raise RecipeError(
                "`rollout.reward.kind: callable` needs `rollout.reward.function` (`package.module:function`)."
            )
        if recipe.train.cache_reference_logps:
            raise RecipeError(
                "`train.cache_reference_logps` cannot be used with rollouts (`rollout.every`): completions are new "
                "every rollout. Fix: set `train.cache_reference_logps=false`."
            )
    if recipe.eval.every is not None and recipe.data.eval is None and recipe.data.eval_fraction == 0.0:
        raise RecipeError(
            f"`eval.every: {recipe.eval.every}` needs held-out data. Fix: set `data.eval.path` (or `data.eval.name`), "
            "or `data.eval_fraction` (e.g. 0.05), or `eval.every=null`."
        )
    resume = recipe.checkpoint.resume
    if resume not in ("auto", "never") and not Path(resume).exists():
        raise RecipeError(
            f"`checkpoint.resume: {resume}` is neither `auto`, `never` nor an existing checkpoint path. "
            "Fix: point it at a directory under `<output_dir>/checkpoints/`, or use `auto`."
        )
    for key, source in (("data.train", recipe.data.train), ("data.eval", recipe.data.eval)):
        if source is not None and source.path is not None and not Path(source.path).exists():
            raise RecipeError(
                f"`{key}.path: {source.path}` does not exist (looked relative to {os.getcwd()}). "
                "Fix: give an existing .jsonl/.json/.parquet file, or use `name` for a Hugging Face dataset."
            )
    if _looks_local(recipe.model.name_or_path) and not Path(recipe.model.name_or_path).exists():
        written_by_a_run = Path(recipe.model.name_or_path).name == "final"
        raise RecipeError(
            f"`model.name_or_path: {recipe.model.name_or_path}` looks like a local directory but does not exist. "
            + ("It is the `final/` model of another run: train that run first (for `recipes/repro/*`: "
               "`python launchers/run.py recipes/repro/warmup.yaml`), or point the key at its output. "
               if written_by_a_run else "")
            + "Fix: give an existing model directory, or a Hugging Face name such as `meta-llama/Meta-Llama-3-8B-Instruct`."
        )
    if world_size is not None:
        batch_layout(recipe, world_size)


def _looks_local(name: str) -> bool:
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


# ------------------------------------------------------------------------------------------------
# Loading: YAML + defaults inheritance + overrides
# ------------------------------------------------------------------------------------------------


def _read_yaml(path: Path) -> Dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(f"Recipe file `{path}` not found. Fix: check the path (recipes live under recipes/).")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise RecipeError(f"Recipe `{where}` is not valid YAML ({problem}). Fix the syntax at that line.")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(f"Recipe `{path}` must be a YAML mapping of groups (model:, data:, ...), got {type(data).__name__}.")
    return data


def deep_merge(base: Dict[str, Any], override: Dict[str, Any]) -> Dict[str, Any]:
    """Recursively merge mappings; values in ``override`` win, lists are replaced whole."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _resolve_defaults(path: Path, stack: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    path = path.resolve()
    if path in stack:
        chain = " -> ".join(str(p) for p in stack + (path,))
        raise RecipeError(f"`defaults:` inheritance loops ({chain}). Fix: remove one of the references.")
    data = _read_yaml(path)
    bases = data.pop("defaults", []) or []
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise RecipeError(f"`defaults` in `{path}` must be a list of recipe file paths (relative to that file).")
    merged: Dict[str, Any] = {}
    for base in bases:
        base_path = (path.parent / base)
        if not base_path.exists():
            raise RecipeError(
                f"`defaults` in `{path}` names `{base}`, which does not exist at `{base_path}`. "
                "Fix: paths in `defaults` are relative to the recipe file."
            )
        merged = deep_merge(merged, _resolve_defaults(base_path, stack + (path,)))
    return deep_merge(merged, data)


def parse_override(text: str) -> Tuple[List[str], Any]:
    """``"train.lr=1e-5"`` -> ``(["train", "lr"], 1e-5)``; the value is parsed as YAML."""
    if "=" not in text:
        raise RecipeError(
            f"Command-line override `{text}` has no `=`. Fix: write overrides as `group.key=value`, e.g. `train.lr=1e-5`."
        )
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise RecipeError(f"Command-line override `{text}` has an empty key part. Fix: e.g. `engine.zero_stage=3`.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_overrides(data: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    data = copy.deepcopy(data)
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if i == 0 and part == "objective" and isinstance(child, str):
                child = node[part] = {"name": child}  # `objective: kto` shorthand, then `objective.beta=...`
            if not isinstance(child, dict):
                raise RecipeError(
                    f"Override `{text}`: `{'.'.join(parts[: i + 1])}` is a value, not a group, so it has no `{parts[i + 1]}`."
                )
            node = child
        node[parts[-1]] = value
    return data


def _model_for_loc(loc: Sequence[Any], objective: Optional[str] = None):
    """The schema class at ``loc`` (``objective`` picks the objective's own class)."""
    if list(loc[:1]) == ["objective"]:
        model, loc = OBJECTIVE_CONFIGS.get(objective, DPOObjective), loc[1:]
    else:
        model = Recipe
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not fields or part not in fields:
            return None
        annotation = fields[part].annotation
        model = _unwrap_model(annotation)
        if model is None:
            return None
    return model


def _unwrap_model(annotation):
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _unwrap_model(arg)
        if found is not None:
            return found
    return None


def _describe_error(err: Dict[str, Any]) -> str:
    loc, objective = list(err["loc"]), None
    if len(loc) >= 2 and loc[0] == "objective" and loc[1] in OBJECTIVE_CONFIGS:
        objective, loc = loc[1], ["objective", *loc[2:]]  # drop the union tag pydantic adds
    key = ".".join(str(p) for p in loc) or "(recipe)"
    kind = err["type"]
    given = err.get("input")
    if kind == "extra_forbidden":
        parent = _model_for_loc(loc[:-1], objective)
        choices = list(parent.model_fields) if parent else []
        hint = did_you_mean(str(loc[-1]), choices)
        known = f" Known keys here: {', '.join(choices)}." if choices else ""
        scope = f" for objective `{objective}`" if objective else ""
        return f"Unknown recipe key `{key}`{scope}.{hint}{known} Fix: remove it or correct the spelling."
    if kind == "missing":
        field = _model_for_loc(loc[:-1], objective)
        desc = ""
        if field is not None and loc[-1] in field.model_fields:
            desc = field.model_fields[loc[-1]].description or ""
        return f"Missing required recipe key `{key}`" + (f" ({desc})" if desc else "") + f". Fix: add `{key}` to the recipe or its `defaults`."
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    shown = repr(given) if not isinstance(given, dict) else "a mapping"
    return f"Recipe key `{key}` is invalid: {msg} (got {shown}). Fix: correct `{key}` in the recipe or override it with `{key}=...`."


def validate_recipe_dict(data: Dict[str, Any], source: str = "recipe") -> Recipe:
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        first = _describe_error(errors[0])
        more = ""
        if len(errors) > 1:
            others = "; ".join(_describe_error(e) for e in errors[1:4])
            more = f" ({len(errors) - 1} more problem(s): {others})"
        raise RecipeError(f"{source}: {first}{more}")


def load_recipe(path: Union[str, Path], overrides: Sequence[str] = ()) -> Recipe:
    """Read, inherit, override and validate a recipe (no cross-field checks: see ``check_recipe``)."""
    path = Path(path)
    data = _resolve_defaults(path)
    data = apply_overrides(data, overrides)
    data.setdefault("name", path.stem)
    if "output_dir" not in data:
        data["output_dir"] = str(Path("runs") / data["name"])
    return validate_recipe_dict(data, source=str(path))


def recipe_to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


# ------------------------------------------------------------------------------------------------
# Key reference (docs/recipe-keys.md is generated from the schema: `python -m hl_core.config`)
# ------------------------------------------------------------------------------------------------


def _type_name(annotation) -> str:
    text = str(annotation) if getattr(annotation, "__origin__", None) is not None else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "").replace("NoneType", "null").replace("|", "\\|")


def recipe_keys_markdown() -> str:
    """Every recipe key with its type, default and description, as Markdown."""
    from pydantic_core import PydanticUndefined

    lines = [
        "# Recipe keys",
        "",
        "Generated from `hl_core/config.py` by `python -m hl_core.config > docs/recipe-keys.md`; do not edit by hand.",
        "",
    ]
    # (key prefix, schema class, section title)
    queue = [("", Recipe, "recipe")]
    while queue:
        prefix, model, title = queue.pop(0)
        rows = []
        for name, field in model.model_fields.items():
            key = f"{prefix}.{name}" if prefix else name
            if model is Recipe and name == "objective":
                queue += [("objective", cls, f"objective (name: {tag})") for tag, cls in OBJECTIVE_CONFIGS.items()]
                continue
            sub = _unwrap_model(field.annotation)
            if sub is not None:
                queue.append((key, sub, key))
                continue
            if field.default is PydanticUndefined and field.default_factory is None:
                default = "**required**"
            else:
                default = f"`{field.default_factory() if field.default_factory is not None else field.default}`"
            rows.append(f"| `{key}` | `{_type_name(field.annotation)}` | {default} | {field.description or ''} |")
        lines += [f"## {title}", "", " ".join((model.__doc__ or "").split()), ""]
        if rows:
            lines += ["| key | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(recipe_keys_markdown())
