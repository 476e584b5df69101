"""Run under torchrun (gloo): the real SmolLM2-135M-Instruct (issue 46) converted to megatron-core at one layout.

argv: REPORT MODEL_DIR TP PP. Every rank loads the Hugging Face model from MODEL_DIR (fp32, eager attention), converts
its weights with ``hl_core.engines.megatron_convert`` into its own (pp, tp) shard (tied embeddings: the last stage's
output layer is a copy of the embedding), and compares on a real sentence:

* pp = 1: the logits gathered over TP (harness only) against HF's, max absolute and relative (to HF's largest);
* every layout: per-token log-probs against HF's (the pp > 1 path: the engine's pipeline schedule);
* the live shards merged back to HF names against the HF weights, bit for bit (the conversion back is lossless).

Writes a JSON report (rank 0).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.engines import megatron_cpu  # noqa: E402

dist.init_process_group("gloo")
megatron_cpu.install()

from megatron.core import (  # noqa: E402
    parallel_state as ps,
    tensor_parallel,  # noqa: E402
)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hl_core.engines.megatron_convert import hf_state_dict, hf_to_mcore, mcore_to_hf  # noqa: E402
from hl_core.engines.megatron_engine import pipeline_token_logps, vocab_parallel_token_logps  # noqa: E402
from hl_core.engines.megatron_specs import (  # noqa: E402
    build_gpt_model,
    causal_mask,
    logits_transform,
    transformer_config,
)
from hl_core.logprobs import sequence_token_logps  # noqa: E402

report_path, model_dir, tp, pp = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome.",
         "What is 21 + 39? Answer with the number only. 60"]

tok = AutoTokenizer.from_pretrained(model_dir)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
cfg = hf.config
enc = tok(TEXTS, return_tensors="pt", padding="max_length", max_length=16, truncation=True)
ids = enc["input_ids"]
N, T = ids.shape
sd = hf_state_dict(hf)
with torch.no_grad():
    hf_logits = hf(input_ids=ids).logits
    hf_logps = sequence_token_logps(hf, ids, torch.ones_like(ids))
del hf

ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
tensor_parallel.model_parallel_cuda_manual_seed(5)
config = transformer_config(cfg, tp=tp, pp=pp, dtype=torch.float32, cpu=True)
model = build_gpt_model(cfg, config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage(),
                        pp_rank=ps.get_pipeline_model_parallel_rank())
key = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
shard = hf_to_mcore(sd, cfg, tp, pp, ranks=[key])[key]
params = dict(model.named_parameters())
assert set(params) == set(shard), set(params) ^ set(shard)
with torch.no_grad():
    for name, p in params.items():
        p.copy_(shard[name])
model.eval()

row = {"tp": tp, "pp": pp, "world": dist.get_world_size(), "tokens": N * T,
       "tied": bool(cfg.tie_word_embeddings), "shard_has_output_layer": "output_layer.weight" in shard}
mask = causal_mask(T)
transform = logits_transform(config)
with torch.no_grad():
    if pp == 1:
        logits = model(ids, torch.arange(T)[None].expand(N, -1), mask)
        full = tensor_parallel.gather_from_tensor_model_parallel_region(transform(logits) if transform else logits)
        row["local_vocab"] = logits.shape[-1]
        row["logits_max_abs_diff"] = (full - hf_logits).abs().max().item()
        row["logits_max_rel_diff"] = row["logits_max_abs_diff"] / hf_logits.abs().max().item()
        logps = vocab_parallel_token_logps(logits, ids, chunk_size=8, transform=transform)
    else:
        logps = pipeline_token_logps(model, ids, num_microbatches=2, chunk_size=8, transform=transform,
                                     attention_mask=mask)
row["logps_max_abs_diff"] = (logps - hf_logps).abs().max().item()
items = [None] * dist.get_world_size()
dist.all_gather_object(items, (key, {n: p.detach() for n, p in model.named_parameters()}))
back = mcore_to_hf(dict(items), cfg, tp, pp)
row["roundtrip_names_match"] = set(back) == set(sd)
row["roundtrip_exact"] = row["roundtrip_names_match"] and all(torch.equal(back[k], sd[k]) for k in sd)
rows = [None] * dist.get_world_size()
dist.all_gather_object(rows, row)
if dist.get_rank() == 0:
    Path(report_path).write_text(json.dumps(rows, indent=1))
ps.destroy_model_parallel()
dist.barrier()
dist.destroy_process_group()
