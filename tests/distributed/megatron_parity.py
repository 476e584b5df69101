"""Run under torchrun (2 processes, gloo): megatron-core models vs Hugging Face, per family and layout.

For tiny random Llama, Qwen2 (q/k/v biases, tied embeddings) and Gemma 2 (soft-capping, sliding
window, zero-centred norms, tied embeddings) and the layouts tp=1 (x2 data parallel), tp=2 and
pp=2, with weights converted by ``hl_core.engines.megatron_convert``:

* logits (pp=1, gathered over TP here, in the harness only) and token log-probs vs HF;
* log-probs identical on every rank;
* the gradient of ``sum(logps * g)`` (pp=2: through the engine's two-pass pipeline path, then the
  tied-embedding all-reduce) merged back to HF names vs HF's own gradient;
* live parameters merged back to HF names == the HF weights, bit for bit;
* Gemma 2 controls: switching its sliding window or its score soft-capping off changes the logits
  (so the features are exercised by the comparison).

Writes a JSON report (rank 0) to argv[1].
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.engines import megatron_cpu  # noqa: E402

torch.manual_seed(0)
dist.init_process_group("gloo")
megatron_cpu.install()

from megatron.core import (  # noqa: E402
    parallel_state as ps,
    tensor_parallel,  # noqa: E402
)
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config  # noqa: E402

from hl_core.engines.megatron_convert import hf_state_dict, hf_to_mcore, mcore_to_hf  # noqa: E402
from hl_core.engines.megatron_engine import (  # noqa: E402
    allreduce_tied_embedding_grads,
    pipeline_token_logps,
    vocab_parallel_token_logps,
)
from hl_core.engines.megatron_specs import build_gpt_model, causal_mask, logits_transform, transformer_config  # noqa: E402
from hl_core.logprobs import sequence_token_logps  # noqa: E402

report_path = sys.argv[1]
rank = dist.get_rank()
COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, initializer_range=0.15)
CONFIGS = {
    "llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
    "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
    "gemma2": Gemma2Config(**COMMON, tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=24,
                           attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
}
LAYOUTS = [(1, 1), (2, 1), (1, 2)]
N, T = 4, 12


def hf_model(family, cfg):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # norms and biases away from their init values, so their mapping matters
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def gather_merge(local, cfg, tp, pp):
    """Harness only: every rank's {(pp, tp): shard} to all ranks, merged to HF names."""
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, ((ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()), local))
    return mcore_to_hf(dict(items), cfg, tp, pp)


def build(cfg, tp, pp, **overrides):
    config = transformer_config(cfg, tp=tp, pp=pp, dtype=torch.float32, cpu=True, **overrides)
    model = build_gpt_model(cfg, config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                            pp_rank=ps.get_pipeline_model_parallel_rank())
    return model, config


def load(model, sd, cfg, tp, pp):
    key = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    shard = hf_to_mcore(sd, cfg, tp, pp, ranks=[key])[key]
    params = dict(model.named_parameters())
    assert set(params) == set(shard), set(params) ^ set(shard)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard[name])


results = []
ids = torch.randint(0, COMMON["vocab_size"], (N, T), generator=torch.Generator().manual_seed(2))
g = torch.randn(N, T, generator=torch.Generator().manual_seed(3))
for family, cfg in CONFIGS.items():
    hf = hf_model(family, cfg)
    sd = hf_state_dict(hf)
    hf_logits = hf(input_ids=ids).logits.detach()
    hf_logps = sequence_token_logps(hf, ids, torch.ones_like(ids))
    (hf_logps * g).sum().backward()
    hf_grads = {name: p.grad.detach().clone() for name, p in hf.named_parameters() if name in sd}
    hf_logps = hf_logps.detach()
    for tp, pp in LAYOUTS:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        tensor_parallel.model_parallel_cuda_manual_seed(5)
        model, config = build(cfg, tp, pp)
        load(model, sd, cfg, tp, pp)
        model.train()  # dropout is 0: train mode is what the engine runs
        row = {"family": family, "tp": tp, "pp": pp}
        mask = causal_mask(T)
        if pp == 1:
            position_ids = torch.arange(T)[None].expand(N, -1)
            logits = model(ids, position_ids, mask)
            transform = logits_transform(config)
            full = tensor_parallel.gather_from_tensor_model_parallel_region(transform(logits) if transform else logits)
            row["logits_diff"] = (full - hf_logits).abs().max().item()
            row["local_vocab"] = logits.shape[-1]
            logps = vocab_parallel_token_logps(logits, ids, chunk_size=5, transform=transform)
            (logps * g).sum().backward()
            logps = logps.detach()
        else:
            logps = pipeline_token_logps(model, ids, num_microbatches=2, chunk_size=5,
                                         transform=logits_transform(config), attention_mask=mask)
            pipeline_token_logps(model, ids, num_microbatches=2, chunk_size=5, transform=logits_transform(config),
                                 attention_mask=mask, grad_logps=g)
            allreduce_tied_embedding_grads(model)
        row["logps_diff"] = (logps - hf_logps).abs().max().item()
        everyone = [torch.empty_like(logps) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, logps)
        row["logps_same_on_all_ranks"] = all(torch.equal(everyone[0], x) for x in everyone)
        grads = gather_merge({n: p.grad.detach() for n, p in model.named_parameters()}, cfg, tp, pp)
        row["grad_names_match"] = set(grads) == set(hf_grads)
        row["grad_diff"] = max((grads[k] - hf_grads[k]).abs().max().item() for k in hf_grads)
        row["grad_scale"] = max(v.abs().max().item() for v in hf_grads.values())
        weights = gather_merge({n: p.detach() for n, p in model.named_parameters()}, cfg, tp, pp)
        row["weights_roundtrip_exact"] = set(weights) == set(sd) and all(torch.equal(weights[k], sd[k]) for k in sd)
        if family == "gemma2" and (tp, pp) == (1, 1):
            with torch.no_grad():
                for name, override in (("no_window_diff", {"sliding_layers": ()}),
                                       ("no_softcap_diff", {"attn_logit_softcapping": None})):
                    control, _ = build(cfg, tp, pp, **override)
                    load(control, sd, cfg, tp, pp)
                    out = logits_transform(config)(control(ids, torch.arange(T)[None].expand(N, -1), mask))
                    row[name] = (out - hf_logits).abs().max().item()
        results.append(row)
        del model
        ps.destroy_model_parallel()

if rank == 0:
    Path(report_path).write_text(json.dumps(results, indent=1))
dist.barrier()
dist.destroy_process_group()
