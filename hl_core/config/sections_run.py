"""The recipe groups around training: held-out and post-training evaluation, logging, rollouts, cluster."""

from __future__ import annotations

from typing import List, Literal, Optional, Union

from pydantic import Field

from .sections import MAX_SEED, _Section


class _GenerationEval(_Section):
    backend: Literal["auto", "hf", "vllm"] = Field("auto",
                                                   description="auto = vllm when installed with a GPU, else hf.")
    chat_template: Union[Literal["auto"],
                         bool] = Field("auto", description="Use the model's chat template (auto: when it has one).")
    batch_size: int = Field(8, ge=1, description="Generation batch size (hf backend).")
    limit: Optional[int] = Field(None, ge=1, description="Evaluate only the first N items.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Sampling seed (0 to 2^32 - 1).")
    dtype: str = Field("auto", description="Model dtype for generation: auto | float32 | bfloat16 | float16.")


class Math500EvalConfig(_GenerationEval):
    """MATH-500 pass@1 through lm-eval (task `hl_math500`), scored with math-verify."""

    enabled: bool = Field(False, description="Run MATH-500 after training.")
    data: Optional[str] = Field(
        None,
        description="Local .jsonl/.json/.parquet in the MATH-500 schema, or a HF dataset name; null = "
                    "`HuggingFaceH4/MATH-500`."
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
        None,
        description="Local JSON/JSONL (instruction, output = reference output, generator, dataset); null = hub "
                    "`tatsu-lab/alpaca_eval`."
    )
    hub_config: str = Field("alpaca_eval_gpt4_baseline",
                            description="Hub file/config with the instructions + reference outputs.")
    reference_outputs: Optional[str] = Field(None, description="Separate file of reference outputs (by instruction).")
    judge: str = Field(
        "api:weighted_alpaca_eval_gpt-4.1",
        description="api:NAME (alpaca_eval annotator config; needs OPENAI_API_KEY), rm:MODEL (a reward model such as "
        "ArmoRM) or py:MODULE:FUNCTION (a callable).",
    )
    rm_mode: Literal["hard", "soft"] = Field("hard",
                                             description="Reward-model preference: higher reward wins, or 1 + "
                                                         "sigmoid(dr).")
    rm_batch_size: int = Field(8, ge=1, description="Reward-model scoring batch size.")
    trust_remote_code: bool = Field(False, description="Allow the judge model's custom code (ArmoRM needs it).")
    length_controlled: Literal["auto", "off"] = Field("auto",
                                                      description="Compute the LC win rate when its GLM inputs exist.")
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
    held_out: Literal["auto", "loss", "reward"] = Field(
        "auto", description="What a held-out evaluation measures: `loss` (the objective's loss and metrics on "
        "`data.eval` examples), `reward` (one sampled completion per `data.eval` prompt, scored by "
        "`rollout.reward`, with `rollout.temperature` / `max_new_tokens`; also its win rate against the first "
        "evaluation), or `auto` (reward with rollouts, else loss). `reward` works for offline runs too.",
    )
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
    data_quality: DataQualityEvalConfig = Field(default_factory=DataQualityEvalConfig,
                                                description="Data-quality proxy.")


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
    progress_bar: Optional[bool] = Field(
        None, description="tqdm progress bars on rank 0: null (default) shows them only when stderr is a terminal, "
        "so a log file gets a plain metrics line every `log_every` updates instead of bar repaints; true forces them, "
        "false turns them off. Off, the run's other bars (tokenizing, reference log-probs, model writes, downloads) "
        "are off too.",
    )
    tensorboard: bool = Field(False, description="Write TensorBoard events to output_dir/tensorboard.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases sink.")


class RewardConfig(_Section):
    """How rollouts are scored."""

    kind: Literal["math", "reward_model", "callable"] = Field(
        "math", description="`math` (math-verify against the reference answer), `reward_model` (a sequence "
        "classifier such as ArmoRM) or `callable` (`function`)."
    )
    accuracy_weight: float = Field(1.0, description="math: weight of a correct final answer (the MATH runs used 8).")
    format_weight: float = Field(0.0,
                                 description="math: weight of the `<think>...</think><answer>...</answer>` format.")
    format_style: Literal["lenient", "newlines"] = Field(
        "lenient", description="math: the format rule: `lenient` (any whitespace around the tags, nothing after) or "
        "`newlines` (the open-r1 fork's: each tag on its own line, `</answer>` at the end of a line).",
    )
    tag_count_weight: float = Field(
        0.0, description="math: weight of the tag-count term (0.25 for each of `<think>\\n`, `\\n</think>\\n`, "
        "`\\n<answer>\\n`, `\\n</answer>` occurring exactly once; the MATH runs used 1).",
    )
    model: Optional[str] = Field(None, description="reward_model: model name or directory.")
    trust_remote_code: bool = Field(False, description="reward_model: allow its custom code (ArmoRM needs it).")
    batch_size: int = Field(16, ge=1, description="reward_model: sequences per scoring batch.")
    score_index: int = Field(0, ge=0, description="reward_model: logit used as the score (when no `.score` output).")
    function: Optional[str] = Field(
        None, description="callable: `package.module:function(prompts, completions, references) -> list[float]`."
    )


class VLLMRolloutConfig(_Section):
    """The vLLM sampler (`rollout.backend: vllm`): one in-process engine per data-parallel rank (tensor parallel 1),
    beside training on the same device; the policy's weights are pushed into it before every rollout that follows
    an update (per bucket under ZeRO-3) and its prefix cache is reset at each push."""

    kv_cache_memory_gb: float = Field(
        8.0, gt=0, description="Memory reserved for the engine's KV cache, in GiB (vLLM's `kv_cache_memory_bytes`; "
        "on the CPU build, host RAM). The default leaves an 80 GB GPU to training: the engine's own copy of the "
        "weights comes on top (16 GB for an 8B model in bf16).",
    )
    kv_cache_dtype: Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="KV-cache dtype (`auto`: the engine's `dtype`).",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The engine's weight and activation dtype; `auto`: `float32` when `engine.precision` is "
        "`fp32`, else `bfloat16`.",
    )
    max_model_len: Optional[int] = Field(
        None, ge=1, description="Longest prompt + completion the engine accepts; null: the model config's "
        "`max_position_embeddings`.",
    )
    enforce_eager: Optional[bool] = Field(
        None, description="Run the engine's forwards eagerly (no CUDA graphs / compilation); null: eager on the CPU, "
        "graphs on a GPU.",
    )
    bucket_mb: float = Field(
        512.0, gt=0, description="Under ZeRO-3, parameters are gathered and pushed in buckets of at most this many "
        "MiB (one parameter larger than that is a bucket of its own): never a whole second copy of the weights.",
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
        "auto",
        description="`hf` (our batched decode loop on the live policy), `vllm` (an in-process vLLM engine per rank, "
        "`rollout.vllm`), `auto` (vllm on a GPU when installed, else hf)."
    )
    kv_cache: Literal["auto", "dynamic", "static"] = Field(
        "auto", description="The `hf` sampler's KV cache: `dynamic` (grows each step), `static` (preallocated for the "
        "whole decode; on a GPU the decode step is compiled and replayed as a CUDA graph), `auto` (`static` on a GPU "
        "unless ZeRO-3 ranks decode in lockstep, else `dynamic`). Same samples for the same seeds either way.",
    )
    num_generations: int = Field(8, ge=2, description="Completions per prompt (a GRPO group / the best-vs-worst pool).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (GRPO log-probs use it too).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    max_new_tokens: int = Field(256, ge=1, description="Generation length cap.")
    stop: List[str] = Field(default_factory=list, description="Stop strings (in addition to EOS).")
    threshold: float = Field(
        0.01, ge=0, description="Online DPO/KTO (and GRPO with `group: best_worst`): keep a prompt's best-vs-worst "
        "pair only when their scores differ by more.",
    )
    group: Literal["all", "best_worst"] = Field(
        "all", description="GRPO rollouts: `all` of a prompt's samples form its group; `best_worst`: only its highest- "
        "and lowest-scored samples, a group of two, left out (weight 0) unless their scores differ by more than "
        "`threshold` (the authors' online GRPO on UltraFeedback labelled pairs this way).",
    )
    system_prompt: Optional[str] = Field(None, description="System message put before every prompt.")
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED,
                                description="Sampling seed (0 to 2^32 - 1); defaults to `train.seed`.")
    log_samples: bool = Field(
        False, description="Append every generated group (prompt, completions, scores) to "
        "`output_dir/rollouts/rank<R>.jsonl`.",
    )
    replay: Optional[str] = Field(
        None, description="Train on the groups a run logged with `log_samples` (its `rollouts/` folder, or one "
        "`.jsonl` file) instead of sampling them: token ids and scores as logged, for the same updates and data "
        "positions (that run's data, `train.seed`, batch layout, `every` and `num_generations`; anything else is "
        "refused). With `every` = `train.max_steps`: one offline set sampled from the initial policy, shared by "
        "several runs.",
    )
    reward: RewardConfig = Field(default_factory=RewardConfig, description="How completions are scored.")
    vllm: VLLMRolloutConfig = Field(default_factory=VLLMRolloutConfig, description="The vLLM sampler's engine.")


class ClusterConfig(_Section):
    """SLURM cluster settings used by the launchers."""

    nodes: int = Field(1, ge=1, description="SLURM nodes.")
    gpus_per_node: int = Field(8, ge=1, description="GPUs per node.")
    partition: Optional[str] = Field(None, description="SLURM partition.")
    time: Optional[str] = Field(None, description="SLURM time limit, e.g. `24:00:00`.")
    gpu_memory_gb: float = Field(80.0, gt=0, description="Memory of one GPU, for `--plan` warnings.")
    container: Optional[str] = Field(None, description="Container image for the SLURM job.")


class CheckpointConfig(_Section):
    """Resumable checkpoints and the final Hugging Face export."""

    save_every: Optional[int] = Field(
        None, ge=1, description="Save a resumable checkpoint every N updates, and at the end of a finished run (so "
        "a rerun with a larger `train.max_steps` extends it); null: only when a run is stopped early.",
    )
    keep_last: int = Field(2, ge=1, description="Resumable checkpoints kept on disk.")
    resume: str = Field(
        "auto", description="`auto` (the newest complete checkpoint in output_dir if any), `never`, or a path."
    )
    save_final: bool = Field(True, description="Write `final/`, a Hugging Face model directory, at the end.")
    overwrite: bool = Field(
        False, description="Let a run start afresh in an `output_dir` that holds another run (`resume: never`, a "
        "checkpoint of another directory, or `auto` beside a finished run's `final/` with no checkpoint), or resume "
        "an older checkpoint than the newest: that run's newer checkpoints and `final/` are deleted first. Without "
        "it such a run is refused (exit code 2): two runs in one directory would mix.",
    )
