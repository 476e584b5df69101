"""A weight push of the real model (SmolLM2-135M-Instruct): run under torchrun (one rank) in the vLLM environment.

    torchrun --nproc_per_node 1 tests/vllm_cpu/real_push_check.py OUT.json MODEL_DIR

MODEL_DIR is the converted Hugging Face directory of the real model (``hl_core.storage.gguf_models``). The pack's
DeepSpeed engine (ZeRO-0, fp32) holds the policy and the pack's `VLLMSampler` (float32 engine) starts from MODEL_DIR.
Four phases, each: vLLM samples (temperature 1) with its log-probs of the sampled tokens, and the policy's own
log-probs of those tokens are computed (fp32, one forward per completion):

* ``start``: no push yet: vLLM runs the checkpoint it loaded (the check of the checkpoint in transformers 5.19);
* ``step``: one real AdamW step of the policy (every parameter moves), then a push; the samples are also scored
  by a copy of the policy taken before the step (the weights vLLM started with): the control that the push changed
  what vLLM computes;
* ``embedding``: noise added to the tied embedding only (the input embedding and the LM head are one tensor), then a
  push; the samples are also scored by the policy without the noise: the control that vLLM's LM head, not only its
  input embedding, took the pushed tensor;
* ``no_head_refresh``: the negative control: the embedding moved again and pushed without `refresh_tied_lm_heads`.

OUT.json: per phase, the largest difference from the pushed policy over all sampled tokens and (``step``,
``embedding``) the smallest, over completions, of a completion's largest difference from the control weights; the
pushed parameter names; timings.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
QUESTIONS = ("What is the capital of France?", "What is 17 + 25?", "Name a colour.", "Say hello in Spanish.")
STEP_LR = 1e-4  # one AdamW step moves every parameter by about this much
EMBEDDING_NOISE = 0.01  # sd of the noise; the embedding's entries have sd 0.14


def token_logps(module, prompt, completion):
    """The fp32 log-probs of ``completion``'s tokens after ``prompt`` under ``module`` (one forward)."""
    import torch

    with torch.no_grad():
        logits = module(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def largest_diffs(module, rows):
    """Per completion: the largest |module's log-prob - vLLM's| over its tokens."""
    import torch

    return [(token_logps(module, p, c) - torch.tensor(lp, dtype=torch.float32)).abs().max().item()
            for p, c, lp in rows]


def prompts_of(tokenizer):
    """Chat-template prompts: the questions, and one longer than a 128-token KV block (a system prompt repeated)."""
    def render(question, system=None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    long_system = " ".join(["You are a careful assistant who answers in one short sentence."] * 14)
    return [render(q) for q in QUESTIONS] + [render("What is the largest planet?", long_system)]


def sample(sampler, prompts, seeds):
    """vLLM's samples (2 per prompt) as ``(prompt, completion, vLLM log-probs)`` rows."""
    completions, logps = sampler.generate(prompts, 2, seeds, logprobs=True)
    return [(p, c, lp) for p, group, lps in zip(prompts, completions, logps) for c, lp in zip(group, lps)]


def train_step(engine, rows, rng):
    """One real optimizer step: raise or lower (random signs) the log-probs of the sampled completions."""
    import torch

    engine.mark_accumulation_boundary(True)
    loss = 0.0
    for prompt, completion, _ in rows:
        logits = engine.policy(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).mean()
        loss = loss - rng.choice((-1.0, 1.0)) * logp
    engine.backward(loss / len(rows))
    engine.step()


def phase(name, sampler, module, prompts, seeds, push=True):
    """Push (unless ``push`` is false), sample, and compare with ``module``: the phase's report and its rows."""
    start = time.monotonic()
    if push:
        sampler.push_weights()
    pushed = time.monotonic()
    rows = sample(sampler, prompts, seeds)
    sampled = time.monotonic()
    diffs = largest_diffs(module, rows)
    report = {"phase": name, "max_logp_diff": max(diffs), "push_s": pushed - start, "sample_s": sampled - pushed,
              "score_s": time.monotonic() - sampled, "completions": len(rows),
              "tokens": sum(len(c) for _, c, _ in rows), "long_prompts": sum(len(p) > 128 for p in prompts)}
    return report, rows


def stale_head_phase(sampler, engine, embedding, prompts, seeds):
    """The negative control: the embedding moved again, pushed without `refresh_tied_lm_heads` (vLLM's LM head keeps
    its prepacked copy of the old embedding): the log-prob check must see it."""
    import torch

    from hl_core.rollout import vllm_sampler

    refresh = vllm_sampler.refresh_tied_lm_heads
    vllm_sampler.refresh_tied_lm_heads = lambda model: 0
    try:
        with engine.generation_module() as (module, _, _):
            with torch.no_grad():
                embedding.add_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(1))
                               * EMBEDDING_NOISE)
            report, _ = phase("no_head_refresh", sampler, module, prompts, seeds)
    finally:
        vllm_sampler.refresh_tied_lm_heads = refresh
    return report


def main(argv) -> int:
    out_path, model_dir = Path(argv[1]), argv[2]
    began = time.monotonic()
    import torch

    from hl_core.config import load_recipe, sampling
    from hl_core.engines import build_engine
    from hl_core.models.loading import load_tokenizer
    from hl_core.rollout.generation import prompt_seed
    from hl_core.rollout.vllm_sampler import VLLMSampler

    recipe = load_recipe(REPO / "recipes/tiny/online_grpo_digits.yaml", [
        f"model.name_or_path={model_dir}", "model.random_init=false", "model.attn_implementation=sdpa",
        "rollout.backend=vllm", "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.max_new_tokens=16",
        "rollout.vllm.kv_cache_memory_gb=0.125", "rollout.vllm.max_model_len=512", "rollout.vllm.dtype=float32",
        f"train.lr={STEP_LR}", "train.warmup_steps=0", f"output_dir={out_path.parent / 'run'}",
    ])
    tokenizer = load_tokenizer(recipe.model)
    engine = build_engine(recipe, tokenizer)
    started = time.monotonic()
    sampler = VLLMSampler(engine, tokenizer, sampling(recipe))
    report = {"load_s": started - began, "engine_start_s": time.monotonic() - started, "phases": []}
    prompts = prompts_of(tokenizer)
    seeds = [prompt_seed(recipe.train.seed, p) for p in range(len(prompts))]
    rng = random.Random(0)
    with engine.generation_module() as (module, _, _):
        first, rows = phase("start", sampler, module, prompts, seeds, push=False)
    report["phases"].append(first)
    original = copy.deepcopy(engine.policy.module).eval()  # the weights vLLM started with
    train_step(engine, rows[:4], rng)
    with engine.generation_module() as (module, _, _):
        stepped, rows = phase("step", sampler, module, prompts, seeds)
    stepped["min_diff_from_original"] = min(largest_diffs(original, rows))
    report["phases"].append(stepped)
    del original
    embedding = engine.policy.module.get_input_embeddings().weight
    assert embedding is engine.policy.module.get_output_embeddings().weight, "the embeddings are not tied"
    noise = torch.randn(embedding.shape, generator=torch.Generator().manual_seed(0)) * EMBEDDING_NOISE
    with engine.generation_module() as (module, _, _):
        with torch.no_grad():
            embedding.add_(noise)
        moved, rows = phase("embedding", sampler, module, prompts, seeds)
        with torch.no_grad():
            embedding.sub_(noise)
        moved["min_diff_from_unpushed"] = min(largest_diffs(module, rows))
    report["phases"].append(moved)
    report["phases"].append(stale_head_phase(sampler, engine, embedding, prompts, seeds))
    report["pushed_names"] = [name for bucket in engine.weight_buckets(sampler.bucket_bytes) for name, _ in bucket]
    report["total_s"] = time.monotonic() - began
    out_path.write_text(json.dumps(report))
    sampler.close()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
