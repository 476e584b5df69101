"""Megatron-core for your own loop: the public helpers that `examples/megatron_dpo.py` builds its model with.

Humanline itself needs nothing from here (`hl_core.humanline` pairs any list of Megatron-core model chunks); these
are the pieces a Megatron-core loop needs *around* it that megatron-core does not ship: running on a CPU over gloo,
and a `GPTModel` chunk holding this rank's slice of a Hugging Face checkpoint (Llama, Mistral, Qwen 2/2.5/3,
Gemma 1/2). They are the functions the pack's own Megatron engine uses, kept stable within a minor version (0.1.x)
like `hl_core.humanline`; `hl_core.engines`, which they wrap, is not.

Needs the `megatron` extra: `pip install -e ".[megatron]"`.
"""

from __future__ import annotations

import torch

from .engines import megatron_cpu
from .engines.megatron_convert import hf_state_dict, hf_to_mcore
from .engines.megatron_specs import build_gpt_model, causal_mask, transformer_config, uses_transformer_engine

__all__ = ["causal_mask", "gpt_chunk_from_hf", "use_cpu"]


def use_cpu() -> None:
    """Let megatron-core run on a CPU over gloo (no CUDA, no fused kernels); call it before the process group.

    Installs the same small shims the pack's Megatron engine uses on CPU (CUDA device queries answered for the CPU,
    the RNG tracker, `nn.Module.cuda` as a no-op, the CUDA-only allocations of the pipeline schedules). Idempotent.
    """
    megatron_cpu.install()


def gpt_chunk_from_hf(hf_model, *, tp: int, tp_rank: int, pp: int = 1, pp_rank: int = 0,
                      dtype: torch.dtype = torch.float32):
    """A megatron-core `GPTModel` chunk holding this rank's tensor- and pipeline-parallel slice of HF weights.

    Args:
        hf_model: the Hugging Face causal LM (``AutoModelForCausalLM.from_pretrained(...)``), on every rank.
        tp: the tensor-parallel size; it must divide the attention and key-value heads.
        tp_rank: this rank's tensor-parallel rank (``parallel_state.get_tensor_model_parallel_rank()``).
        pp: the pipeline-parallel size; it must divide the layers.
        pp_rank: this rank's pipeline stage.
        dtype: the parameters' dtype.

    Returns:
        The chunk (`megatron.core.models.gpt.GPTModel`), its parameters set to this rank's slice. Its forward takes
        ``(input_ids [B, T], position_ids [B, T], causal_mask(T))`` and, on the last stage, returns this rank's
        vocabulary slice of the logits, ``[B, T, V / tp]``.
    """
    hf_config = hf_model.config
    config = transformer_config(hf_config, tp=tp, pp=pp, dtype=dtype, cpu=not torch.cuda.is_available())
    model = build_gpt_model(hf_config, config, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                            pp_rank=pp_rank)
    shard = hf_to_mcore(hf_state_dict(hf_model), hf_config, tp, pp, ranks=[(pp_rank, tp_rank)],
                        te=uses_transformer_engine(hf_config))[(pp_rank, tp_rank)]
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard[name])
    return model

