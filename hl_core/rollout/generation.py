"""Sampling completions from the current policy (our batched decode loop; vLLM: `vllm_sampler`).

Reproducibility: all prompts of a micro-batch are decoded in one batch, but each prompt's group of
``num_generations`` samples draws from its own generator, seeded from the run seed and the prompt's
position in the data stream, so the samples of a prompt do not depend on how prompts are spread over
ranks (one process and two ZeRO-3 processes give the same samples). Under ZeRO-3 with several ranks
every rank runs all ``max_new_tokens`` forwards (lockstep), so ranks whose completions end earlier do
not deadlock the others.
"""

from __future__ import annotations

import contextlib
import importlib.util
from typing import List, Optional, Sequence, Tuple

import torch

from ..config.decisions import Sampling

# Imports inside functions: vLLM is optional, loaded only for `rollout.backend: vllm` (or `auto` on a GPU);
# transformers only on the static-cache path.

SEED_STRIDE = 1_000_003  # seed(prompt position p) = base * SEED_STRIDE + p


def prompt_seed(base_seed: int, position: int) -> int:
    return (base_seed * SEED_STRIDE + position) % (2**63 - 1)


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (renormalised)."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


@torch.no_grad()
def sample_groups(model, groups: Sequence[Tuple[List[int], int, int]], *, max_new_tokens: int, eos_token_id: int,
                  pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False,
                  stop: Sequence[str] = (), tokenizer=None, lockstep: bool = False,
                  device: Optional[torch.device] = None, kv_cache: str = "dynamic", step=None,
                  pool: Optional[dict] = None) -> List[List[List[int]]]:
    """Ancestral sampling for many prompts in one left-padded batch with a KV cache.

    ``groups`` holds ``(prompt_ids, num, seed)``: ``num`` completions of the prompt, drawn from the
    prompt's own ``torch.Generator(seed)``, so a prompt's samples do not depend on which other prompts
    share the batch (or the rank). Each step: ``p = softmax(logits / temperature)``, nucleus-filtered,
    one draw per row (argmax when ``greedy``). A row ends at EOS (kept) or once its text contains a
    ``stop`` string. ``lockstep`` runs all ``max_new_tokens`` forwards even when every row has ended
    (ZeRO-3 ranks must call forward equally often). Returns completions per group, EOS included.

    ``kv_cache``: ``dynamic`` (the cache and the attention mask grow each step) or ``static`` (one cache of
    `static_cache_length` positions allocated up front, the mask covering it, each step writing at its
    ``cache_position``: fixed shapes, so a GPU can replay the decode step as a CUDA graph). ``step``: what runs the
    one-token decode steps of the static path (default ``model``; a compiled copy of its forward on a GPU).
    ``pool``: a dict in which the static cache is kept between calls (reset, not reallocated, when the next call
    has the same rows and length: a CUDA graph replays only over the same buffers). The draws are the same in both:
    only the positions a row may attend differ in how they are stored.
    """
    n_groups = len(groups)
    if lockstep and not any(num for _, num, _ in groups):  # still take part in every collective forward
        groups = [([pad_token_id], 1, 0)]
    rows = [list(prompt) for prompt, num, _ in groups for _ in range(num)]
    if not rows:
        return [[] for _ in groups]
    device = device or torch.device("cpu")
    width = max(len(p) for p in rows)
    ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], dtype=torch.long, device=device)
    generators = [torch.Generator(device=device).manual_seed(int(seed)) for _, _, seed in groups]
    spans, first = [], 0
    for _, num, _ in groups:
        spans.append((first, first + num))
        first += num
    step_pos = (mask.cumsum(-1) - 1).clamp(min=0)
    done = torch.zeros(len(rows), dtype=torch.bool, device=device)
    lengths = torch.full((len(rows),), max_new_tokens, dtype=torch.long, device=device)
    tokens = torch.full((len(rows), max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    cache, step_ids = None, ids
    if kv_cache == "static":
        cache, mask = _static_cache(model, mask, width + max_new_tokens, pool)
    for t in range(max_new_tokens):
        if kv_cache == "static":
            out = _static_step(model if t == 0 else (step or model), step_ids, mask, step_pos, cache, width
                               + max(t - 1, 0), t)
        else:
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        last = out.logits[:, -1, :].float()
        if greedy:
            chosen = last.argmax(-1)
        else:
            probs = _nucleus(torch.softmax(last / temperature, dim=-1), top_p)
            chosen = torch.empty(len(rows), dtype=torch.long, device=device)
            for (lo, hi), generator in zip(spans, generators):
                if hi > lo:
                    chosen[lo:hi] = torch.multinomial(probs[lo:hi], 1, generator=generator).squeeze(-1)
        chosen = chosen.masked_fill(done, pad_token_id)
        tokens[:, t] = chosen
        ended = ~done & (chosen == eos_token_id)
        if stop and tokenizer is not None:
            for r in (~done & ~ended).nonzero().flatten().tolist():
                if any(s in tokenizer.decode(tokens[r, : t + 1].tolist(), skip_special_tokens=True) for s in stop):
                    ended[r] = True
        lengths = torch.where(ended, torch.full_like(lengths, t + 1), lengths)
        done |= ended
        if not lockstep and bool(done.all()):
            break
        step_ids = chosen.unsqueeze(-1)
        if kv_cache != "static":
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        step_pos = step_pos[:, -1:] + 1
    tokens, lengths = tokens.cpu().tolist(), lengths.cpu().tolist()
    return [[tokens[r][: lengths[r]] for r in range(lo, hi)] for lo, hi in spans][:n_groups]


STATIC_BUCKET = 64  # static cache lengths are rounded up to this: fewer distinct shapes (CUDA graphs) per run


def static_cache_length(positions: int) -> int:
    return -(-positions // STATIC_BUCKET) * STATIC_BUCKET


def _static_cache(model, mask: torch.Tensor, positions: int, pool: Optional[dict] = None):
    """A transformers ``StaticCache`` for ``positions`` (rounded up; from ``pool`` and reset when it holds one of
    this size, else a new one that replaces it there) and the prompt mask widened to cover it."""
    from transformers import StaticCache  # transformers (seconds to import): only the static path needs it here

    length = static_cache_length(positions)
    key = (mask.shape[0], length)
    cache = (pool or {}).get(key)
    if cache is None:
        cache = StaticCache(config=model.config, max_cache_len=length)
        if pool is not None:
            pool.clear()  # one cache at a time: its memory is held between rollouts
            pool[key] = cache
    else:
        cache.reset()
    full = mask.new_zeros(mask.shape[0], length)
    full[:, :mask.shape[1]] = mask
    return cache, full


def _static_step(forward, step_ids, mask, step_pos, cache, position: int, t: int):
    """Step ``t`` of the static path: the prompt (``t == 0``, positions ``0 .. width - 1``), else one token written
    at ``position``, which the mask now admits."""
    if t == 0:
        cache_position = torch.arange(step_ids.shape[1], device=step_ids.device)
    else:
        mask[:, position] = 1
        cache_position = torch.full((1,), position, dtype=torch.long, device=step_ids.device)
        if torch.cuda.is_available() and step_ids.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs were read
    return forward(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=cache,
                   cache_position=cache_position, use_cache=True, logits_to_keep=1)


def decode_step(module, device: torch.device):
    """What runs the static path's one-token steps: on a GPU, the module's forward compiled with CUDA graphs
    (``mode="reduce-overhead"``: fixed shapes, replayed without a kernel launch per operation); on the CPU, the
    module itself."""
    if device.type != "cuda":
        return module

    compiled = torch.compile(module.forward, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def step(**kwargs):
        with torch.compiler.set_stance("default"):  # `train.compile` runs generation eagerly; this step is compiled
            return compiled(**kwargs)

    return step


@contextlib.contextmanager
def without_input_grad_hooks(module):
    """transformers' gradient checkpointing hooks the input embeddings so that their output requires grad
    (``enable_input_require_grads``); a decode step compiled whole (``fullgraph``) cannot trace that
    ``requires_grad_`` (torch 2.11 stops at a graph break, seen on an H100), and sampling needs no grads, so the
    hooks are off while the static path decodes and back on for training."""
    hooked = getattr(module, "_require_grads_hook",
                     None) is not None or bool(getattr(module, "_require_grads_hooks", None))
    if hooked:
        module.disable_input_require_grads()
    try:
        yield
    finally:
        if hooked:
            module.enable_input_require_grads()


class HFSampler:
    """Batched sampling from the live policy (our own decode loop; works under every ZeRO stage)."""

    name = "hf"

    def __init__(self, engine, tokenizer, rollout_cfg):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, rollout_cfg
        self._step = (None, None)  # (module, its decode step): compiled once per module on a GPU
        self._pool = {}  # the static KV cache, kept between rollouts

    def kv_cache(self, device: torch.device, lockstep: bool) -> str:
        """``rollout.kv_cache``; ``auto`` is ``static`` on a GPU unless ZeRO-3 ranks decode in lockstep (their
        forwards gather parameters in Python hooks, which a CUDA graph cannot replay)."""
        if self.cfg.kv_cache != "auto":
            return self.cfg.kv_cache
        return "static" if device.type == "cuda" and not lockstep else "dynamic"

    def sample_groups(self, prompts: List[List[int]], num: int, seeds: List[int],
                      greedy: bool = False) -> List[List[List[int]]]:
        """``num`` completions of each prompt (token ids, EOS included when generated), prompt ``i``
        drawn under ``seeds[i]``."""
        with self.engine.generation_module() as (module, device, lockstep):
            kv_cache = self.kv_cache(device, lockstep)
            if kv_cache == "static" and self._step[0] is not module:
                self._step = (module, decode_step(module, device))
            hooks_off = without_input_grad_hooks(module) if kv_cache == "static" else contextlib.nullcontext()
            with hooks_off:
                return sample_groups(
                    module, [(list(p), num, s) for p, s in zip(prompts, seeds)],
                    max_new_tokens=self.cfg.max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                    pad_token_id=self.tokenizer.pad_token_id, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                    greedy=greedy, stop=self.cfg.stop, tokenizer=self.tokenizer, lockstep=lockstep, device=device,
                    kv_cache=kv_cache, step=self._step[1] if kv_cache == "static" else None, pool=self._pool,
                )

    def push_weights(self) -> None:
        """Generation reads the live policy weights: nothing to push."""


def vllm_usable() -> bool:
    """``rollout.backend: auto`` picks vLLM on a GPU where it is installed (the CPU build is for tests: opt in with
    ``rollout.backend: vllm``)."""
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def build_sampler(engine, tokenizer, sampling: Sampling):
    """The run's sampler: `VLLMSampler` (one engine per rank, at any world size) for ``rollout.backend: vllm``, or
    ``auto`` where vLLM is usable; else `HFSampler`."""
    cfg = sampling.rollout
    if cfg.backend == "vllm" or (cfg.backend == "auto" and vllm_usable()):
        from .vllm_sampler import VLLMSampler

        return VLLMSampler(engine, tokenizer, sampling)
    return HFSampler(engine, tokenizer, cfg)
