"""Run under torchrun (2 processes, gloo, tp=2): ``SDPAttention`` equals megatron-core's own
``DotProductAttention`` (same constructor, so the same module with the two forwards), for grouped
query attention, in the forward output and in the gradients of query, key and value. Writes a JSON
report (rank 0) to argv[1]."""

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
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from hl_core.engines.megatron_attention import SDPAttention  # noqa: E402
from hl_core.engines.megatron_cpu import CPU_CONFIG_FLAGS  # noqa: E402
from hl_core.engines.megatron_specs import causal_mask  # noqa: E402

ps.initialize_model_parallel(tensor_model_parallel_size=2)
tensor_parallel.model_parallel_cuda_manual_seed(0)
heads, groups, head_dim, seq, batch = 8, 2, 16, 24, 3
config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                           num_query_groups=groups,
                           kv_channels=head_dim, use_cpu_initialization=True, attention_dropout=0.0, **CPU_CONFIG_FLAGS)
local_heads, local_groups = heads // 2, groups // 2
gen = torch.Generator().manual_seed(1 + ps.get_tensor_model_parallel_rank())
inputs = [torch.randn(seq, batch, n, head_dim, generator=gen) for n in (local_heads, local_groups, local_groups)]
outputs, grads = {}, {}
for cls in (DotProductAttention, SDPAttention):
    module = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = module(*leaves, attention_mask=causal_mask(seq))
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    outputs[cls.__name__], grads[cls.__name__] = out.detach(), [t.grad for t in leaves]
report = {
    "shape": list(outputs["SDPAttention"].shape),
    "forward_diff": (outputs["SDPAttention"] - outputs["DotProductAttention"]).abs().max().item(),
    "grad_diff": max((a - b).abs().max().item() for a, b in zip(grads["SDPAttention"], grads["DotProductAttention"])),
    "output_scale": outputs["DotProductAttention"].abs().max().item(),
}
if dist.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(report))
ps.destroy_model_parallel()
dist.destroy_process_group()
