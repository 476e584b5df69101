"""Pushed weights are the ones vLLM uses: run under torchrun (one rank or two) in the vLLM environment.

    torchrun --nproc_per_node N tests/vllm_cpu/push_check.py OUT.json ZERO_STAGE UPDATES [--no-reset-last]

A real DeepSpeed engine trains the tiny head_dim-32 model (random init) and each rank's in-process vLLM engine
(``rollout.backend: vllm``) samples. Before each of UPDATES updates: push the weights, then on this rank's prompts
(short ones and ones longer than two 128-token KV blocks)

* sample (temperature 1) with vLLM's log-probs of the sampled tokens, and compute the policy's own log-probs of
  those tokens (fp32, one forward per completion): their largest difference;
* greedy-decode with vLLM and with our HF loop on the live policy: how many prompts agree token for token;

then take one real optimizer step on the sampled completions. ``--no-reset-last``: the last push skips the prefix-cache
reset (the negative control: the check must see the stale KV there). The first push's samples (by prompt position)
go to the output too, for the world-size comparison of seeds. Rank 0 writes OUT.json with every rank's numbers.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(argv) -> int:
    out_path, zero_stage, updates = Path(argv[1]), int(argv[2]), int(argv[3])
    no_reset_last = "--no-reset-last" in argv
    import torch

    from hl_core.config import load_recipe, sampling
    from hl_core.engines import build_engine
    from hl_core.models.loading import load_tokenizer
    from hl_core.rollout.generation import prompt_seed, sample_groups
    from hl_core.rollout.vllm_sampler import VLLMSampler

    recipe = load_recipe(REPO / "recipes/tiny/online_grpo_digits.yaml", [
        "rollout.backend=vllm", "model.name_or_path=tests/fixtures/tiny/model_hd32", f"engine.zero_stage={zero_stage}",
        "rollout.max_new_tokens=12", "rollout.vllm.kv_cache_memory_gb=0.0625", "rollout.vllm.bucket_mb=0.05",
        "train.lr=0.01", "train.warmup_steps=0", f"output_dir={out_path.parent / 'run'}",
    ])
    tokenizer = load_tokenizer(recipe.model)
    engine = build_engine(recipe, tokenizer)
    sampler = VLLMSampler(engine, tokenizer, sampling(recipe))
    rank, world = engine.rank, engine.world_size
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id}
    vocab = [t for t in range(len(tokenizer)) if t not in special]
    rng = random.Random(0)
    short = [tokenizer.encode(f"{a}+{b}=") for a, b in ((57, 83), (4, 9), (120, 7), (33, 33))]
    long = [[rng.choice(vocab) for _ in range(length)] for length in (300, 270)]  # > 2 KV blocks of 128
    all_prompts = short + long
    positions = list(range(rank, len(all_prompts), world))  # this rank's share
    prompts = [all_prompts[p] for p in positions]
    seeds = [prompt_seed(recipe.train.seed, p) for p in positions]
    lockstep = zero_stage == 3 and world > 1
    sizes = [getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.policy.module.parameters()]
    buckets = [sum(t.numel() * t.element_size() for _, t in b) for b in engine.weight_buckets(sampler.bucket_bytes)]
    report = {"rank": rank, "world": world, "updates": [], "first_samples": {}, "bucket_bytes": buckets,
              "bucket_limit": sampler.bucket_bytes, "params_bytes": sum(sizes), "largest_param_bytes": max(sizes)}
    for update in range(updates):
        sampler.push_weights(reset_prefix_cache=not (no_reset_last and update == updates - 1))
        completions, vllm_logps = sampler.generate(prompts, 2, seeds, logprobs=True)
        if update == 0:
            report["first_samples"] = {str(p): c for p, c in zip(positions, completions)}
        rows = [(prompt, c, lp) for prompt, group, lps in zip(prompts, completions, vllm_logps)
                for c, lp in zip(group, lps)]
        with engine.generation_module() as (module, device, _):
            diffs = []
            for prompt, completion, lp in rows:  # one forward per completion (ZeRO-3 ranks: same count each)
                ids = torch.tensor([prompt + completion])
                logits = module(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
                own = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
                diffs.append((own - torch.tensor(lp, dtype=torch.float32)).abs().max().item())
            hf_greedy = [sample_groups(module, [(p, 1, 0)], max_new_tokens=recipe.rollout.max_new_tokens,
                                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                       greedy=True, lockstep=lockstep)[0][0] for p in prompts]
        vllm_greedy = [group[0] for group in sampler.sample_groups(prompts, 1, seeds, greedy=True)]
        report["updates"].append({
            "update": update, "reset": not (no_reset_last and update == updates - 1),
            "max_logp_diff": max(diffs),
            "max_logp_diff_long": max(d for (p, _, _), d in zip(rows, diffs) if len(p) > 256)
            if any(len(p) > 256 for p in prompts) else None,
            "greedy_equal": sum(a == b for a, b in zip(vllm_greedy, hf_greedy)), "prompts": len(prompts),
            "long_prompts": sum(len(p) > 256 for p in prompts), "hf_greedy": hf_greedy, "vllm_greedy": vllm_greedy,
        })
        # one real update: raise the log-probs of the sampled completions with random signs (the weights move)
        engine.mark_accumulation_boundary(True)
        weights = torch.tensor([rng.choice((-1.0, 1.0)) for _ in rows])
        ids = [torch.tensor(p + c) for p, c, _ in rows]
        loss = 0.0
        for w, (prompt, completion, _), seq in zip(weights, rows, ids):
            logits = engine.policy(input_ids=seq[None]).logits[0, len(prompt) - 1:-1].float()
            loss = loss - w * torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).mean()
        engine.backward(loss / len(rows))
        engine.step()
    gathered = [None] * world
    torch.distributed.all_gather_object(gathered, report)
    if rank == 0:
        out_path.write_text(json.dumps(gathered))
    sampler.close()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
