"""Megatron-core engine: policy and reference ``GPTModel`` shards with one tensor/pipeline layout.

Layout. ``parallel.tp`` x ``parallel.pp`` model-parallel groups, data parallel over the rest
(megatron-core's rank order ``tp-cp-ep-dp-pp``). Policy and reference are built by the same code
with the same layout, so each rank holds the same TP/PP slice of both and humanline syncing copies
``param.data`` shard by shard (no collective, no gather). Runs that never read the reference (SFT) build
none.

Weights. ``model.random_init`` builds the Hugging Face model from its config with ``train.seed``
(exactly as the DeepSpeed engine does) and converts it; otherwise each rank reads only its own
stage's tensors from the HF safetensors (``megatron_convert.LazyHFCheckpoint``) and slices its TP
part. Resumable checkpoints and ``save_hf`` (which gathers the shards to rank 0 and merges them back
into a HF directory) are in ``megatron_checkpoint.py``, a mixin of this engine.

Log-probs. ``token_logps`` returns ``[N, T]`` float32 aligned like ``sequence_token_logps``
(``out[:, 0] = 0``), identical on every rank of the model-parallel group. The log-softmax is
vocab-parallel (megatron-core's ``vocab_parallel_cross_entropy``: a max and two sums all-reduced
over the TP group; full-vocabulary logits are never gathered), chunked over the sequence
(``megatron_logps.py``, with the pipeline schedule's forward/backward below).

Pipeline parallel (pp > 1): the trainer computes the loss from log-probs (``token_logps`` ->
transform -> objective -> ``backward``), while Megatron's schedules fuse forward and backward.
The engine bridges the two in two passes:

1. ``token_logps(batch, "policy")`` with grad enabled runs the schedule forward-only; the last
   stage broadcasts the log-probs over the pipeline group, and every rank returns them as a leaf
   tensor that requires grad (the forward is remembered, with the RNG state it started from).
2. ``backward(loss)`` differentiates the loss w.r.t. those leaves (``g = dL/dlogps``, the same on
   every rank) and runs the schedule forward+backward (1F1B) with the surrogate loss
   ``sum(logps * g)`` on the last stage, whose parameter gradient is exactly ``dL/dtheta``. The
   RNG state is restored for this recomputation, so dropout masks match pass 1.

The price is one extra policy forward per micro-batch under pp > 1 (pp = 1 backpropagates
directly). The trainer's micro-batch is split into pipeline micro-batches (``_num_microbatches``).

Optimizer. On GPU: megatron-core ``DistributedDataParallel`` + the distributed optimizer
(``get_megatron_optimizer``, gradient clipping inside), grads finalized with
``finalize_model_grads``. On CPU (tests): megatron's optimizer hard-codes CUDA, so a torch AdamW
over the local shards, with data-parallel gradient averaging, the tied-embedding gradient
all-reduce between first and last stage, and a model-parallel grad norm done here.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
from torch.distributed import constants as dist_constants

from ..config import batch_layout, pipeline_microbatches, reference_model_needed
from ..errors import RecipeError
from ..humanline import ParameterPairs, pair_parameters
from ..logprobs import chunk_positions
from ..models.loading import DTYPES, build_causal_lm, rehearsing_weights
from . import megatron_cpu
from .base import Engine, launch_environment, lr_lambda
from .megatron_checkpoint import LAYOUT_FILE, MegatronCheckpointing, _resolve_weights_dir
from .megatron_convert import LazyHFCheckpoint, hf_state_dict, hf_to_mcore
from .megatron_logps import pipeline_token_logps, vocab_parallel_token_logps
from .megatron_specs import build_gpt_model, causal_mask, logits_transform, transformer_config, uses_transformer_engine
from .rendezvous import said_if_waiting

# Imports inside functions: megatron-core is an optional extra (`pip install -e .[megatron]`) and heavy; it loads when
# a megatron engine is built, after the CPU shims (megatron_cpu.py) are in place.


def allreduce_tied_embedding_grads(model) -> None:
    """pp > 1 with tied embeddings: the first stage's embedding and the last stage's output layer are
    copies of one weight; both get the sum of their gradients (``.grad``; CPU path)."""
    from megatron.core import parallel_state as ps

    if not getattr(model, "share_embeddings_and_output_weights",
                   False) or ps.get_pipeline_model_parallel_world_size() == 1:
        return
    if ps.is_rank_in_embedding_group():
        weight = model.shared_embedding_or_output_weight()
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        torch.distributed.all_reduce(weight.grad, group=ps.get_embedding_group())


@dataclass
class _PendingForward:
    """A policy forward run forward-only under pp > 1, waiting for ``backward`` to recompute it."""

    input_ids: torch.Tensor
    logps: torch.Tensor  # the leaf handed to the trainer
    temperature: float
    rng: Any


def _init_distributed(backend: Optional[str]) -> None:
    if not torch.distributed.is_initialized():
        backend = launch_environment(backend)
        nccl = backend == "nccl" and dist_constants.default_pg_nccl_timeout is not None
        timeout = dist_constants.default_pg_nccl_timeout if nccl else dist_constants.default_pg_timeout
        with said_if_waiting(timeout, "torch's default"):
            torch.distributed.init_process_group(backend=backend, timeout=timeout)


class MegatronEngine(MegatronCheckpointing, Engine):
    def __init__(self, recipe, tokenizer):
        from megatron.core import parallel_state as ps, tensor_parallel

        self.recipe, self.tokenizer = recipe, tokenizer
        self.cpu = not torch.cuda.is_available()
        if self.cpu:
            megatron_cpu.install()
        _init_distributed(recipe.engine.dist_backend)
        self.rank = torch.distributed.get_rank()
        self.world_size = torch.distributed.get_world_size()
        self.tp, self.pp = recipe.parallel.tp, recipe.parallel.pp
        self.dp_size, self.gradient_accumulation_steps = batch_layout(recipe, self.world_size)
        if self.cpu:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(self.device)
        # a rehearsal's fake process group (hl_core.rehearsal) has no gloo twin to build megatron's CPU groups on
        self._gloo = torch.distributed.get_backend() != "fake"
        if not ps.model_parallel_is_initialized():
            ps.initialize_model_parallel(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                                         create_gloo_process_groups=self._gloo)
        self.ps = ps
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        assert ps.get_data_parallel_world_size() == self.dp_size
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()

        train = recipe.train
        seed = train.seed + 100 * self.pp_rank  # Megatron's convention; TP ranks differ inside the tracker
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

        from transformers import AutoConfig

        model_cfg = recipe.model
        self.hf_config = AutoConfig.from_pretrained(
            model_cfg.name_or_path, trust_remote_code=model_cfg.trust_remote_code, **model_cfg.config_overrides
        )
        self.dtype = DTYPES[recipe.engine.precision]
        self.te = uses_transformer_engine(self.hf_config)
        # perform_initialization stays on although every weight is loaded afterwards: megatron-core sets the
        # tensor-parallel attributes (``tensor_model_parallel``, ``partition_dim``) that grad-norm and the
        # distributed optimizer rely on only inside its initializers
        recompute = {}
        if model_cfg.gradient_checkpointing:  # megatron-core's full activation recompute, one layer at a time
            recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if rehearsing_weights():  # each rank draws only its own shard (no whole float32 matrix on the CPU first)
            recompute["use_cpu_initialization"] = False
        self.config = transformer_config(
            self.hf_config, tp=self.tp, pp=self.pp, dtype=self.dtype, cpu=self.cpu, **recompute
        )
        self.logits_transform = logits_transform(self.config)
        policy = self._build_model()
        self._load_initial_weights(policy)
        self.reference = None
        if reference_model_needed(recipe):
            reference = self._build_model()
            with torch.no_grad():
                for p, r in zip(policy.parameters(), reference.parameters()):
                    r.copy_(p)
            for r in reference.parameters():
                r.requires_grad_(False)
            reference.eval()
            self.reference = reference
        policy.train()
        self._build_optimizer(policy)  # sets self.policy (DDP-wrapped on GPU) and self.policy_module
        # humanline's shard-local sync: each rank's TP/PP slices (torch DDP / megatron DDP unwrapped)
        self._sync_pairs = pair_parameters(self.policy_module,
                                           self.reference) if self.has_reference else ParameterPairs([])
        self._pending: List[_PendingForward] = []
        self._micro_steps = 0
        self.updates_done = 0

    # ------------------------------------------------------------------------------------------ build
    def _build_model(self):
        model = build_gpt_model(self.hf_config, self.config, self.first_stage, self.last_stage, pp_rank=self.pp_rank)
        return model.to(self.device)

    def _load_initial_weights(self, model) -> None:
        """This rank's (pp, tp) shard of the HF weights, converted; every parameter must be covered."""
        model_cfg = self.recipe.model
        if model_cfg.random_init and rehearsing_weights():
            # a rehearsal keeps the random shards megatron's initialisers drew (models.loading.rehearsal_weights)
            return
        if model_cfg.random_init:
            hf_model = build_causal_lm(model_cfg, "fp32", self.recipe.train.seed)
            source = hf_state_dict(hf_model)
        else:
            source = LazyHFCheckpoint(_resolve_weights_dir(model_cfg.name_or_path))
        shard = hf_to_mcore(source, self.hf_config, self.tp, self.pp, ranks=[(self.pp_rank, self.tp_rank)], te=self.te)
        self._copy_shard(model, shard[(self.pp_rank, self.tp_rank)])

    def _build_optimizer(self, policy) -> None:
        train = self.recipe.train
        self.max_grad_norm = train.max_grad_norm
        self._lr_fn = lr_lambda(train.warmup_steps, train.max_steps, train.lr_schedule)
        if self.cpu:
            self.policy = self.policy_module = policy
            decay, no_decay = [], []
            for param in policy.parameters():
                (no_decay if param.dim() < 2 else decay).append(param)
            groups = [{"params": ps_, "weight_decay": wd} for ps_, wd in ((decay, train.weight_decay), (no_decay, 0.0))
                      if ps_]
            self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=tuple(train.adam_betas), eps=train.adam_eps)
            return
        # GPU: megatron-core DDP (contiguous grad buffers) + the distributed optimizer. Not exercised by the CPU tests.
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True
        )
        self.policy = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=policy)
        self.policy_module = policy
        opt_config = OptimizerConfig(
            optimizer="adam", lr=train.lr, weight_decay=train.weight_decay, adam_beta1=train.adam_betas[0],
            adam_beta2=train.adam_betas[1], adam_eps=train.adam_eps, clip_grad=train.max_grad_norm or 0.0,
            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype, use_distributed_optimizer=True,
        )
        self.optimizer = get_megatron_optimizer(opt_config, [self.policy], use_gloo_process_groups=self._gloo)

    # ------------------------------------------------------------------------------------------ forward
    def _attention_mask(self, seq_len: int):
        return None if self.te else causal_mask(seq_len, self.device)

    def _forward_logps(self, model, input_ids, temperature: float):
        """One stage-complete forward (pp = 1): vocab-parallel log-probs ``[N, T]``."""
        seq_len = input_ids.shape[1]
        position_ids = torch.arange(seq_len, device=self.device)[None].expand_as(input_ids)
        logits = model(input_ids, position_ids, self._attention_mask(seq_len))
        return vocab_parallel_token_logps(
            logits, input_ids, chunk_positions(input_ids.shape[0], self.recipe.train.logps_chunk_tokens), temperature,
            self.logits_transform,
        )

    def token_logps(self, batch, model: str = "policy", temperature: float = 1.0):
        net = self.policy if model == "policy" else self.require_reference()
        input_ids = batch["input_ids"].to(self.device)
        grad = model == "policy" and torch.is_grad_enabled()
        if self.pp == 1:
            with torch.set_grad_enabled(grad):
                return self._forward_logps(net, input_ids, temperature)
        rng = self._rng_state() if grad else None
        logps = self._pipeline(net, input_ids, temperature)
        if grad:
            logps.requires_grad_(True)
            self._pending.append(_PendingForward(input_ids, logps, temperature, rng))
        return logps

    def _num_microbatches(self, rows: int) -> int:
        """Pipeline micro-batches per trainer micro-batch (``config.pipeline_microbatches``; --plan counts the same)."""
        return pipeline_microbatches(self.recipe, rows)

    def _pipeline(self, net, input_ids, temperature: float, grad_logps: Optional[torch.Tensor] = None):
        return pipeline_token_logps(
            net, input_ids, num_microbatches=self._num_microbatches(input_ids.shape[0]), temperature=temperature,
            chunk_size=chunk_positions(input_ids.shape[0] // self._num_microbatches(input_ids.shape[0]),
                                       self.recipe.train.logps_chunk_tokens),
            transform=self.logits_transform,
            attention_mask=self._attention_mask(input_ids.shape[1]), grad_logps=grad_logps,
        )

    def _rng_state(self):
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        cuda = None if self.cpu else torch.cuda.get_rng_state()
        return torch.get_rng_state(), cuda, {k: v.clone() for k, v in tracker.get_states().items()}

    def _set_rng_state(self, state) -> None:
        from megatron.core import tensor_parallel

        cpu, cuda, tracked = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in tracked.items()})

    def rng_state(self) -> Dict[str, Any]:
        return {**super().rng_state(), "tracker": self._rng_state()[2]}  # the model-parallel dropout streams

    def set_rng_state(self, state: Dict[str, Any]) -> None:
        from megatron.core import tensor_parallel

        super().set_rng_state(state)
        tensor_parallel.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})

    # ------------------------------------------------------------------------------------------ backward / step
    def backward(self, loss: torch.Tensor) -> None:
        scaled = loss / self.gradient_accumulation_steps
        if self.pp == 1:
            scaled.backward()
            return
        pending, self._pending = self._pending, []
        if not pending or not scaled.requires_grad:
            return
        grads = torch.autograd.grad(scaled, [p.logps for p in pending], allow_unused=True)
        now = self._rng_state()
        for forward, grad in zip(pending, grads):
            if grad is None:
                continue
            self._set_rng_state(forward.rng)  # the recomputation sees the same dropout masks
            self._pipeline(self.policy, forward.input_ids, forward.temperature, grad_logps=grad)
        self._set_rng_state(now)

    def is_accumulation_boundary(self) -> bool:
        return (self._micro_steps + 1) % self.gradient_accumulation_steps == 0

    def step(self) -> Optional[Dict[str, float]]:
        boundary = self.is_accumulation_boundary()
        self._micro_steps += 1
        if not boundary:
            return None
        lr = self.recipe.train.lr * self._lr_fn(self.updates_done)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.cpu:
            norm = self._cpu_step()
        else:
            from megatron.core.distributed import finalize_model_grads

            finalize_model_grads([self.policy])
            _, norm, _ = self.optimizer.step()
            self.policy.zero_grad_buffer()
            self.optimizer.zero_grad()
        self.updates_done += 1
        norm = float("nan") if norm is None else float(norm)
        return {"lr": lr, "grad_norm": norm}

    def local_grads(self):
        """Megatron's main grads (GPU: DDP's float32 buffer views), else ``.grad`` (the CPU path)."""
        grads = [getattr(p, "main_grad", None) if getattr(p, "main_grad", None) is not None else p.grad
                 for p in self.policy_module.parameters()]
        return [g for g in grads if g is not None]

    @torch.no_grad()
    def local_weights_finite(self) -> bool:
        return all(bool(p.isfinite().all()) for p in self.policy_module.parameters())

    def skip_step(self) -> Dict[str, float]:
        """End the update without an optimizer step: gradients dropped, the counters advanced."""
        self._micro_steps += 1
        lr = self.recipe.train.lr * self._lr_fn(self.updates_done)
        if self.cpu:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.policy.zero_grad_buffer()
            self.optimizer.zero_grad()
        self.updates_done += 1
        return {"lr": lr, "grad_norm": float("nan")}

    def _cpu_step(self) -> float:
        """Gradient all-reduces, global grad norm, clipping and AdamW on the local shards (CPU path)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        ps = self.ps
        params = [p for p in self.policy_module.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        allreduce_tied_embedding_grads(self.policy_module)
        if self.dp_size > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            torch.distributed.all_reduce(flat, group=ps.get_data_parallel_group())
            flat /= self.dp_size
            offset = 0
            for p in params:
                p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        squares = torch.zeros((), dtype=torch.float32)
        for p in params:
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                squares += p.grad.float().pow(2).sum()
        if self.tp * self.pp > 1:
            torch.distributed.all_reduce(squares, group=ps.get_model_parallel_group())
        norm = squares.sqrt().item()
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                for p in params:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def trained_module(self):
        return self.policy_module

    def generation_module(self):
        raise RecipeError(
            "Online and sparse rollouts (`rollout.every`) generate with the policy, which the megatron engine "
            "does not do yet. Fix: use `engine.name=deepspeed` for rollout recipes, or `rollout.every=null`."
        )

    def full_state_dict(self):
        raise RecipeError("The megatron engine has no full-state export for vLLM yet; use `engine.name=deepspeed`.")

    def weight_buckets(self, bucket_bytes: int):
        raise RecipeError("The megatron engine pushes no weights into vLLM yet; use `engine.name=deepspeed`.")

    def close(self, destroy_process_group: bool = True) -> None:
        self._pending = []
        self.policy = self.policy_module = self.reference = self.optimizer = None
        self._sync_pairs = ParameterPairs([])
        gc.collect()  # free the engines' hooks and buffers while the process group still exists
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            self.ps.destroy_model_parallel()
            if destroy_process_group:
                torch.distributed.destroy_process_group()


__all__ = ["LAYOUT_FILE", "MegatronEngine", "pipeline_token_logps", "vocab_parallel_token_logps"]
