"""New tokens per second of the rollout samplers side by side: vLLM (`rollout.backend: vllm`, an in-process engine)
against our HF decode loop (`rollout.backend: hf`), the same policy, prompts, seeds and settings.

Run it in the vLLM environment (`bash .ci/vllm-env` builds it and prints its python; on a GPU machine, any env with
vLLM)::

    "$(bash .ci/vllm-env)" bench/vllm_vs_hf_sampler.py [--prompts 16] [--num 8] [--max-new-tokens 32] [--repeats 3]
        [--threads 1] [recipe overrides ...]

Default model: the tiny recipes' head_dim-32 variant (random init; vLLM's CPU attention needs head_dim >= 32); a
larger one through overrides, e.g. ``'model.config_overrides={hidden_size: 512, intermediate_size: 1024,
num_hidden_layers: 8, num_attention_heads: 8, num_key_value_heads: 8}'``. Each sampler: one warm-up call, then the
best of ``--repeats`` timed calls (after a weight push for vLLM, as in training; the push is timed apart). New tokens
= the completions' lengths (EOS included). Prints one table and the ratio; speed claims come from here only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--num", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads (set before torch loads)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value) of the digits recipe")
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.chdir(REPO)
    sys.path.insert(0, str(REPO))
    import torch

    from hl_core.config import load_recipe, sampling
    from hl_core.engines import build_engine
    from hl_core.models.loading import load_tokenizer
    from hl_core.rollout.generation import HFSampler, prompt_seed
    from hl_core.rollout.vllm_sampler import VLLMSampler

    recipe = load_recipe(REPO / "recipes/tiny/online_grpo_digits.yaml", [
        "model.name_or_path=tests/fixtures/tiny/model_hd32", "rollout.backend=vllm",
        f"rollout.max_new_tokens={args.max_new_tokens}", "rollout.vllm.kv_cache_memory_gb=0.25",
        "output_dir=/tmp/hl-bench-vllm-vs-hf", *args.overrides])
    tokenizer = load_tokenizer(recipe.model)
    engine = build_engine(recipe, tokenizer)
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.policy.module.parameters())
    prompts = [tokenizer.encode(f"{a}+{b}=") for a, b in zip(range(11, 999, 37), range(93, 999, 53))][:args.prompts]
    seeds = [prompt_seed(recipe.train.seed, p) for p in range(len(prompts))]
    hf = HFSampler(engine, tokenizer, recipe.rollout)
    vllm = VLLMSampler(engine, tokenizer, sampling(recipe))
    vllm.push_weights()
    rows = []
    try:
        for name, sampler in (("hf", hf), ("vllm", vllm)):
            sampler.sample_groups(prompts, args.num, seeds)  # warm-up
            best, tokens, push = float("inf"), 0, 0.0
            for _ in range(args.repeats):
                start = time.perf_counter()
                sampler.push_weights()
                push = max(push, time.perf_counter() - start)
                start = time.perf_counter()
                out = sampler.sample_groups(prompts, args.num, seeds)
                best = min(best, time.perf_counter() - start)
                tokens = sum(len(c) for group in out for c in group)
            rows.append((name, tokens, best, tokens / best, push))
    finally:
        vllm.close()
        engine.close()
    print(f"device: {'cuda' if torch.cuda.is_available() else 'cpu'}, OMP threads {args.threads}, model "
          f"{params / 1e6:.2f}M params ({recipe.engine.precision}), {len(prompts)} prompts x {args.num} samples, "
          f"<= {args.max_new_tokens} new tokens, best of {args.repeats}")
    print(f"{'sampler':8} {'new tokens':>10} {'seconds':>9} {'new tok/s':>10} {'push s':>8}")
    for name, tokens, seconds, rate, push in rows:
        print(f"{name:8} {tokens:>10} {seconds:>9.3f} {rate:>10.0f} {push:>8.4f}")
    print(f"ratio vllm / hf new tokens/s: {rows[1][3] / rows[0][3]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
