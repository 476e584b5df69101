"""DeepSpeed engine: a trainable policy engine and a frozen reference engine with one sharding layout.

* ZeRO-0/1/2: parameters are whole on every rank; the reference is a stage-0 engine and syncing
  copies ``param.data``.
* ZeRO-3: the reference is a stage-3 engine without an optimizer, so its parameters are partitioned
  exactly like the policy's. Syncing copies each rank's own partition (``param.ds_tensor``) and, for
  parameters kept whole under the persistence threshold (``param.ds_persist``), also ``param.data``.
  Nothing is gathered.
* No reference engine at all when the run never reads it (``config.reference_needed``: SFT, standard
  rollout GRPO without a KL term) or reads it without a copy (``config.reference_mode``: a cached frozen
  reference, look-ahead syncing).
* LoRA (``model.lora``, ZeRO 0-2): no reference engine either; the reference is the policy module with its
  adapter off, or with a frozen ``reference`` adapter that syncing overwrites (``engines/lora.py``).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import os
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

from ..config import batch_layout, reference_model_needed
from ..errors import RecipeError
from ..humanline import ParameterPairs, pair_parameters
from ..logprobs import chunk_positions, sequence_token_logps
from ..logprobs.hidden import fused_sequence_token_logps
from ..logprobs.packed import packed_sequence_token_logps
from ..models.loading import build_policy_and_reference
from ..models.speed import RegionalCompile, check_speed_options
from ..storage.checkpoints import check_files, safe_load, wrote_lookahead
from ..storage.deepspeed_checkpoints import deepspeed_safe_globals, safe_checkpoint_engine
from .base import GLOBAL_SEED_OFFSET, Engine, launch_environment, lr_lambda
from .lora import wrap_lora
from .rendezvous import said_if_waiting

# Imports inside functions: deepspeed (seconds to import, and it compiles ops) loads when an engine is built, not when
# this module is named (tests and --plan read its helpers).


SHM_SKIPPED = ("gloo", "fake")  # CPU process groups under which DeepSpeed's shm all-reduce op is not built


def _init_distributed(backend: Optional[str]) -> None:
    """DeepSpeed's process group. Under gloo (CPU ranks) DeepSpeed would JIT-compile its shared-memory all-reduce op
    (about two minutes and a C++ compiler, once per Python environment, and again whenever another environment
    shares torch's extension cache): gloo's own collectives serve the CPU sizes of this pack, so the op is not built.
    Its absence is a path DeepSpeed supports (``build_shm_op`` returns None on platforms without the op; only
    ``inference_all_reduce``, which training never calls, would use it). The same under torch's fake process group
    (``--rehearse``, already initialised: DeepSpeed's communication backend is made here, before
    ``deepspeed.initialize`` would make it with the op), where no peer process exists to share memory with."""
    import deepspeed

    ds_comm = importlib.import_module("deepspeed.comm.torch")  # the attribute `deepspeed.comm.torch` is torch itself
    if torch.distributed.is_initialized():
        backend = torch.distributed.get_backend()
        if backend not in SHM_SKIPPED:
            return
    else:
        backend = launch_environment(backend)
    build = ds_comm.build_shm_op
    if backend in SHM_SKIPPED:
        ds_comm.build_shm_op = lambda: None
    from deepspeed.constants import default_pg_timeout  # DEEPSPEED_TIMEOUT, read when DeepSpeed is imported

    try:
        with said_if_waiting(default_pg_timeout, "DeepSpeed's, `DEEPSPEED_TIMEOUT` in minutes"):
            deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=default_pg_timeout)
    finally:
        ds_comm.build_shm_op = build


def deepspeed_configs(recipe, accumulation: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """DeepSpeed's configs for the policy (ZeRO stage, bf16, clipping) and the reference (no optimizer: ZeRO-3
    partitioned like the policy, else whole)."""
    train, stage = recipe.train, recipe.engine.zero_stage
    bf16 = recipe.engine.precision == "bf16"
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = recipe.engine.zero3_param_persistence_threshold
    policy_config = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if train.max_grad_norm is not None:
        policy_config["gradient_clipping"] = train.max_grad_norm
    reference_config = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "zero_optimization": dict(zero) if stage == 3 else {"stage": 0},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**9,
    }
    return policy_config, reference_config


def adamw(policy: torch.nn.Module, train, fused: bool) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: weight decay on matrices, none on vectors (norms, biases)."""
    decay, no_decay = [], []
    for name, param in policy.named_parameters():
        if not param.requires_grad:  # LoRA's frozen base weights and reference adapter
            continue
        shape = getattr(param, "ds_shape", param.shape)  # loaded under zero.Init: already partitioned
        (no_decay if len(shape) < 2 else decay).append(param)
    groups = [
        {"params": params, "weight_decay": wd}
        for params, wd in ((decay, train.weight_decay), (no_decay, 0.0)) if params
    ]
    return torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps, fused=fused)


class DeepSpeedEngine(Engine):
    def __init__(self, recipe, tokenizer):
        import deepspeed

        self.recipe = recipe
        self.tokenizer = tokenizer
        _init_distributed(recipe.engine.dist_backend)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.dp_size, self.gradient_accumulation_steps = batch_layout(recipe, self.world_size)
        self.dp_rank = self.rank  # data parallel only
        self.zero_stage = recipe.engine.zero_stage
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        train = recipe.train

        policy_config, reference_config = deepspeed_configs(recipe, self.gradient_accumulation_steps)
        self._lora_reference = reference_model_needed(recipe)  # LoRA: a reference adapter (copy mode only)
        self.lora = None
        check_speed_options(recipe)  # model.kernels, train.fused_logprobs: before any weights are built
        policy, reference = build_policy_and_reference(
            recipe.model, recipe.engine.precision, train.seed, policy_config if self.zero_stage == 3 else None,
            with_reference=reference_model_needed(recipe) and not recipe.model.lora_enabled,
            packing=recipe.data.packing,
        )
        check_speed_options(recipe, model_type=policy.config.model_type)
        if recipe.model.lora_enabled:
            synced = self._lora_reference and recipe.humanline.sync_every is not None
            self.lora = wrap_lora(policy, recipe.model.lora, synced, train.seed, recipe.model.gradient_checkpointing)
            policy = self.lora.model
        self.compiled = RegionalCompile(train.compile_backend) if train.compile else None  # each decoder layer
        for model in (policy, reference) if self.compiled else ():
            if model is not None:
                self.compiled.compile(model)
        optimizer = adamw(policy, train, fused=self.device.type == "cuda")
        schedule = lr_lambda(train.warmup_steps, train.max_steps, train.lr_schedule)
        self.policy, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=policy, optimizer=optimizer, config=policy_config,
            # built on DeepSpeed's wrapped optimizer, whose param groups are the ones that get stepped
            lr_scheduler=lambda wrapped: torch.optim.lr_scheduler.LambdaLR(wrapped, schedule),
        )
        self._torch_optimizer = optimizer  # the one DeepSpeed steps (inside its ZeRO wrapper, if any)
        self.policy.checkpoint_engine = safe_checkpoint_engine(self.policy._config)  # weights_only loads
        self.reference, self._sync_pairs = None, ParameterPairs([])
        if reference is not None:
            self.reference, _, _, _ = deepspeed.initialize(model=reference, config=reference_config)
            self.reference.eval()
            self._sync_pairs = pair_parameters(self.policy, self.reference)  # humanline's shard-local sync
        if self.lora is not None:
            self._sync_pairs = self.lora.pairs  # synced: the reference adapter's tensors
        self._last_grad_norm = float("nan")
        # dropout draws from torch's global generator: seeded per rank, after every model is built and wrapped
        self.seed_rngs(train.seed + GLOBAL_SEED_OFFSET + self.rank)

    # -------------------------------------------------------------------------------------------
    @property
    def has_reference(self) -> bool:
        return self.reference is not None or (self.lora is not None and self._lora_reference)

    def token_logps(self, batch, model: str = "policy", temperature: float = 1.0):
        engine = self.policy if model == "policy" else (self.require_reference() or self.policy)  # LoRA: one module
        # the collated batch is on the host: the packed and fused paths build their layouts there (bins, labels,
        # valid positions) and move them, so no device value is read back
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        fused = self.recipe.train.fused_logprobs  # from the hidden states, without the [B, T, V] logits
        if self.recipe.data.packing:  # one forward over bins of `data.max_length` tokens, no padding inside
            forward = functools.partial(packed_sequence_token_logps, capacity=self.recipe.data.max_length,
                                        pad_token_id=self.tokenizer.pad_token_id or 0,
                                        chunk_tokens=self.recipe.train.logps_chunk_tokens,
                                        fused=fused, module=engine.module, device=self.device)
        elif fused:
            forward = functools.partial(fused_sequence_token_logps, block_tokens=self.recipe.train.logps_chunk_tokens,
                                        module=engine.module, device=self.device)
        else:
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            forward = functools.partial(sequence_token_logps,
                                        chunk_size=chunk_positions(input_ids.shape[0],
                                                                   self.recipe.train.logps_chunk_tokens))
        if model == "policy":
            return forward(engine, input_ids, attention_mask, temperature=temperature)
        with torch.no_grad(), (self.lora.reference_forward() if self.lora is not None else contextlib.nullcontext()):
            return forward(engine, input_ids, attention_mask, temperature=temperature)

    def trained_module(self):
        return self.policy.module

    @torch.no_grad()
    @contextlib.contextmanager
    def generation_module(self):
        """``(policy module in eval mode, device, lockstep)`` for the sampler's decode loop. Under ZeRO-3
        with several ranks every forward gathers parameters collectively, so ranks decode in lockstep."""
        module = self.policy.module
        was_training = module.training
        module.eval()
        try:
            with self.compiled.eager() if self.compiled else contextlib.nullcontext():  # decode steps run uncompiled
                yield module, self.device, self.zero_stage == 3 and self.world_size > 1
        finally:
            module.train(was_training)

    def summary_fields(self) -> Dict[str, Any]:
        """``train.compile``: compile time, graphs compiled and recompiles (for the run summary)."""
        return self.compiled.summary() if self.compiled else {}

    def full_state_dict(self):
        """The policy's full weights (gathered under ZeRO-3; rank 0 gets them, others None)."""
        if self.lora is not None:
            return self.lora.merged_state_dict()
        if self.zero_stage == 3:
            return self.policy._zero3_consolidated_16bit_state_dict()
        return {k: v.detach().cpu() for k, v in self.policy.module.state_dict().items()}

    def weight_buckets(self, bucket_bytes: int):
        """The policy's parameters as lists of ``(HF name, tensor)`` of at most ``bucket_bytes`` each (a larger
        parameter alone), for a weight push into an inference engine. ZeRO 0-2: the live tensors (the consumer
        copies them). ZeRO-3: every rank gathers bucket after bucket, together, and gets clones of the gathered
        tensors (the consumer may hold a tensor until a later one completes its layer), so at most one bucket is
        whole at a time, never a full second copy. LoRA: the merged weights."""
        if self.lora is not None:
            yield list(self.lora.merged_state_dict().items())
            return
        named = list(self.policy.module.named_parameters())
        if self.zero_stage != 3:
            yield [(name, param.detach()) for name, param in named]
            return
        import deepspeed

        nbytes = [param.ds_numel * param.element_size() for _, param in named]
        start = 0
        while start < len(named):
            end, size = start + 1, nbytes[start]
            while end < len(named) and size + nbytes[end] <= bucket_bytes:
                size += nbytes[end]
                end += 1
            with deepspeed.zero.GatheredParameters([param for _, param in named[start:end]], modifier_rank=None):
                whole = [(name, param.data.detach().clone()) for name, param in named[start:end]]
            yield whole
            start = end

    def backward(self, loss):
        self.policy.backward(loss)

    def mark_accumulation_boundary(self, is_last: bool) -> None:
        # DeepSpeed would count micro-steps modulo `gradient_accumulation_steps`; the trainer says where the
        # update ends (token-budget updates hold a varying number of micro-batches)
        self.policy.set_gradient_accumulation_boundary(is_last)

    def is_accumulation_boundary(self) -> bool:
        return self.policy.is_gradient_accumulation_boundary()

    def step(self):
        boundary = self.policy.is_gradient_accumulation_boundary()
        lr = self.scheduler.get_last_lr()[0]
        own_norm = None
        if boundary and self.zero_stage == 0 and self.recipe.engine.precision == "fp32":
            # DeepSpeed's plain fp32 path clips but does not record the norm: measure it (pre-clip)
            grads = [p.grad for p in self.policy.module.parameters() if p.grad is not None]
            own_norm = torch.nn.utils.get_total_norm(grads) if grads else 0.0
        self.policy.step()
        if not boundary:
            return None
        norm = own_norm if own_norm is not None else self.policy.get_global_grad_norm()
        if norm is None:
            norm = float("nan")
        # a device tensor stays one (the trainer reads it in the update's totals reduction), a number a float
        norm = norm.detach() if torch.is_tensor(norm) else float(norm)
        return {"lr": lr, "grad_norm": norm}

    def local_grads(self):
        """This rank's gradient storage at an accumulation boundary, before the step: the module's ``.grad``
        (ZeRO-0), the ZeRO optimizer's reduced partitions (ZeRO-1/2/3), or bf16's fp32 accumulators."""
        opt = self.policy.optimizer
        averaged = getattr(opt, "averaged_gradients", None)
        if self.zero_stage > 0 and averaged:
            groups = averaged.values() if isinstance(averaged, dict) else averaged
            return [g for group in groups if group is not None for g in group if g is not None]
        grads = [p.grad for p in self.policy.module.parameters() if p.grad is not None]
        if not grads and hasattr(opt, "fp32_groups_gradients_flat"):
            grads = [g for g in opt.fp32_groups_gradients_flat if g is not None]
        return grads

    @torch.no_grad()
    def local_weights_finite(self) -> bool:
        tensors = []
        for param in self.policy.module.parameters():
            tensors.append(param.ds_tensor if hasattr(param, "ds_tensor") else param.data)
        return all(bool(t.isfinite().all()) for t in tensors if t.numel())

    def skip_step(self) -> Dict[str, float]:
        """End the update without changing the weights or the optimizer: DeepSpeed's step runs its bookkeeping
        (gradients cleared, counters advanced) around a no-op optimizer step; the LR schedule advances as on
        any counted update."""
        lr = self.scheduler.get_last_lr()[0]
        epoch = self.scheduler.last_epoch
        optimizer = self._torch_optimizer
        own = optimizer.__dict__.get("step")  # e.g. the LR scheduler's call-tracking wrapper
        optimizer.step = lambda *args, **kwargs: None
        try:
            self.policy.step()
        finally:
            if own is None:
                del optimizer.step
            else:
                optimizer.step = own
        if self.scheduler.last_epoch == epoch:  # DeepSpeed's own overflow path does not advance it
            self.scheduler.step()
        self.policy.zero_grad()
        return {"lr": lr, "grad_norm": float("nan")}

    # -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _load_reference_shards(self, shards: Dict[str, torch.Tensor]) -> None:
        for name, _, ref in self._sync_pairs:
            target = ref.ds_tensor if hasattr(ref, "ds_tensor") else ref
            if name not in shards or shards[name].shape != target.shape:
                raise RecipeError(
                    f"The reference shards in the checkpoint do not match this run's layout (parameter `{name}`). "
                    "Fix: resume with the same number of processes and `engine.zero_stage` as the saved run."
                )
        self._sync_pairs.load_reference_shards(shards)

    # -------------------------------------------------------------------------------------------
    def save(self, directory: str, tag: str, client_state: Dict[str, Any]) -> None:
        # LoRA: the frozen base is rebuilt from `model.name_or_path`; the reference adapter is kept below
        self.policy.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False,
                                    exclude_frozen_parameters=self.lora is not None)
        # The reference differs from the initial weights once syncing has happened: keep each rank's shard.
        if (self.has_reference and self.recipe.humanline.sync_every is not None
                and (self.zero_stage == 3 or self.rank == 0)):
            path = Path(directory) / tag / f"reference_rank{self.rank:05d}.pt"
            torch.save(self._sync_pairs.reference_shards(), path)
        self.barrier()

    def load(self, directory: str, tag: Optional[str] = None) -> Dict[str, Any]:
        if tag is not None:  # every rank refuses a bad file alike before any loads (``check_files``)
            check_files(Path(directory) / tag, allowed=deepspeed_safe_globals())
        load_path, client_state = self.policy.load_checkpoint(directory, tag=tag, load_module_strict=self.lora is None)
        if load_path is None:
            raise RecipeError(f"No DeepSpeed checkpoint found in `{directory}` (tag {tag}). Fix: check "
                              f"`checkpoint.resume`.")
        if self.has_reference and self.recipe.humanline.sync_every is not None:
            rank = self.rank if self.zero_stage == 3 else 0
            path = Path(directory) / tag / f"reference_rank{rank:05d}.pt"
            if not path.exists() and wrote_lookahead(Path(directory) / tag):
                self._sync_pairs.sync()  # a look-ahead checkpoint keeps no copy: start one from the policy
                self.resynced_at_resume = True
                return client_state or {}
            if not path.exists():
                raise RecipeError(
                    f"Checkpoint `{Path(directory) / tag}` has no reference shard `{path.name}`, but this run syncs "
                    "the reference. Fix: resume from a checkpoint written by a syncing run with the same world size."
                )
            self._load_reference_shards(safe_load(path))
        return client_state or {}

    def save_hf(self, directory: str) -> None:
        if self.lora is not None:  # the adapter in PEFT format (+ `merged/` when asked)
            # a random-init base exists nowhere but in this run: the adapter alone could not be loaded, so merge
            merged = self.recipe.model.lora.save_merged or self.recipe.model.random_init
            if self.rank == 0:
                Path(directory).mkdir(parents=True, exist_ok=True)
                self.lora.save_final(directory, self.tokenizer, merged)
            self.barrier()
            return
        state_dict = self.full_state_dict()
        if self.rank == 0:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.policy.module.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
        self.barrier()

    def close(self, destroy_process_group: bool = True) -> None:
        for engine in (getattr(self, "policy", None), getattr(self, "reference", None)):
            if engine is not None and hasattr(engine, "destroy"):
                try:
                    engine.destroy()
                except Exception:  # teardown must never mask the run's own outcome
                    pass
        self.policy = self.reference = None
        gc.collect()  # free the engines' hooks and buffers while the process group still exists
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            if destroy_process_group:  # DeepSpeed's own teardown also drops the groups it cached (a next engine
                import deepspeed.comm  # in this process would otherwise meet unregistered groups); loaded already

                deepspeed.comm.destroy_process_group()
