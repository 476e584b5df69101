"""Sampling completions from the current policy (Hugging Face ``generate``; vLLM on GPU when installed).

Reproducibility: each prompt's group of ``num_generations`` samples is drawn in its own ``generate``
call under a seed derived from the run seed and the prompt's position in the data stream, so the
samples of a prompt do not depend on how prompts are spread over ranks (one process and two ZeRO-3
processes give the same samples). Under ZeRO-3, ``synced_gpus`` keeps every rank stepping until
all ranks are done, so ranks whose completions end earlier do not deadlock the others.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Sequence

import torch

SEED_STRIDE = 1_000_003  # seed(prompt position p) = base * SEED_STRIDE + p


def prompt_seed(base_seed: int, position: int) -> int:
    return (base_seed * SEED_STRIDE + position) % (2**63 - 1)


@contextlib.contextmanager
def seeded(seed: int):
    """Run a block under ``seed`` without disturbing the global RNG streams (CPU and current CUDA device)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def generation_kwargs(rollout_cfg, tokenizer, greedy: bool = False) -> dict:
    kwargs = dict(
        max_new_tokens=rollout_cfg.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(do_sample=True, temperature=rollout_cfg.temperature, top_p=rollout_cfg.top_p, top_k=0)
    if rollout_cfg.stop:
        kwargs.update(stop_strings=list(rollout_cfg.stop), tokenizer=tokenizer)
    return kwargs


def completion_tokens(sequence: Sequence[int], prompt_length: int, eos_token_id: int, pad_token_id: int) -> List[int]:
    """Generated tokens after the prompt, up to and including the first EOS (padding after it dropped)."""
    out = []
    for token in list(sequence)[prompt_length:]:
        out.append(int(token))
        if token == eos_token_id:
            return out
    # no EOS: generation hit max_new_tokens or a stop string; trailing padding (synced ranks) removed
    while out and out[-1] == pad_token_id and pad_token_id != eos_token_id:
        out.pop()
    return out


class HFSampler:
    """``transformers`` generation through the engine (works under every ZeRO stage)."""

    name = "hf"

    def __init__(self, engine, tokenizer, rollout_cfg):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, rollout_cfg

    def sample_group(self, prompt_ids: List[int], num: int, seed: int) -> List[List[int]]:
        """``num`` completions of one prompt (token ids, EOS included when generated)."""
        ids = torch.tensor([prompt_ids] * num, dtype=torch.long)
        with seeded(seed):
            sequences = self.engine.generate(ids, torch.ones_like(ids), **generation_kwargs(self.cfg, self.tokenizer))
        return [
            completion_tokens(row.tolist(), len(prompt_ids), self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
            for row in sequences
        ]

    def sample_batch(self, prompts: List[List[int]], seed: int, greedy: bool = False) -> List[List[int]]:
        """One completion for each prompt, in one left-padded batch (evaluation)."""
        width = max(len(p) for p in prompts)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long)
        with seeded(seed):
            sequences = self.engine.generate(ids, mask, **generation_kwargs(self.cfg, self.tokenizer, greedy))
        return [completion_tokens(row.tolist(), width, self.tokenizer.eos_token_id, pad) for row in sequences]

    def push_weights(self) -> None:
        """HF generation reads the live policy weights: nothing to push."""


class VLLMSampler(HFSampler):
    """vLLM generation on GPU. The policy's weights are pushed into the vLLM engine after every update
    that is followed by a rollout (``push_weights``); sampling seeds are per prompt, as for ``hf``.

    Not exercised on the CPU build machines (vLLM needs a GPU); see the README's GPU notes.
    """

    name = "vllm"

    def __init__(self, engine, tokenizer, rollout_cfg, model_path: str, gpu_memory_utilization: float = 0.3):
        super().__init__(engine, tokenizer, rollout_cfg)
        from vllm import LLM

        self.llm = LLM(model=model_path, tokenizer=model_path, dtype="bfloat16", enforce_eager=True,
                       gpu_memory_utilization=gpu_memory_utilization, seed=0)

    def _params(self, num: int, seed: int, greedy: bool = False):
        from vllm import SamplingParams

        return SamplingParams(
            n=num, temperature=0.0 if greedy else self.cfg.temperature, top_p=self.cfg.top_p,
            max_tokens=self.cfg.max_new_tokens, stop=list(self.cfg.stop) or None, seed=seed,
        )

    def sample_group(self, prompt_ids, num, seed):
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], self._params(num, seed), use_tqdm=False)
        return [self._with_eos(list(o.token_ids), o.finish_reason) for o in out[0].outputs]

    def sample_batch(self, prompts, seed, greedy=False):
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                self._params(1, seed, greedy), use_tqdm=False)
        return [self._with_eos(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in out]

    def _with_eos(self, tokens: List[int], finish_reason: Optional[str]) -> List[int]:
        eos = self.tokenizer.eos_token_id
        if finish_reason == "stop" and (not tokens or tokens[-1] != eos) and not self.cfg.stop:
            tokens = tokens + [eos]
        return tokens

    def push_weights(self) -> None:
        state = self.engine.full_state_dict()
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        model.load_weights(state.items())


def vllm_usable() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def build_sampler(engine, tokenizer, recipe):
    cfg = recipe.rollout
    use_vllm = cfg.backend == "vllm" or (cfg.backend == "auto" and vllm_usable() and engine.world_size == 1)
    if use_vllm:
        if not vllm_usable():
            from ..errors import RecipeError

            raise RecipeError(
                "`rollout.backend: vllm` needs the `vllm` package and a GPU. Fix: `rollout.backend=hf` (or `auto`)."
            )
        return VLLMSampler(engine, tokenizer, cfg, recipe.model.name_or_path)
    return HFSampler(engine, tokenizer, cfg)
