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

from .engines import megatron_cpu, megatron_specs
from .engines.megatron_convert import hf_state_dict, hf_to_mcore
from .engines.megatron_specs import build_gpt_model, transformer_config, uses_transformer_engine
from .humanline.contract import dtype_arg, refuse, whole_number

__all__ = ["causal_mask", "gpt_chunk_from_hf", "use_cpu"]


def use_cpu() -> megatron_cpu.CpuShims:
    """Let megatron-core run on a CPU over gloo (no CUDA, no fused kernels); use it before the process group.

    Puts in place the small shims the pack's Megatron engine uses on CPU (CUDA device queries answered for the CPU,
    the RNG tracker, ``nn.Module.cuda`` as a no-op, the CUDA-only allocations of the pipeline schedules), each as a
    swap (``hl_core.swaps``). As a context manager (``with use_cpu(): ...``) it takes its shims out at the end of
    the block, leaving any others in place; called as a statement, they stay for the process.

    Returns:
        The ``CpuShims`` handle: ``undo()`` takes these shims out.

    Raises:
        RuntimeError: CUDA is available (the shims are for machines without a GPU).
    """
    return megatron_cpu.shims()


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """The boolean causal mask a `GPTModel` chunk's forward takes: ``[1, 1, T, T]``, True where attention is masked.

    Args:
        seq_len: the sequence length ``T``, a whole number ``>= 1``.
        device: where the mask lives (default: the CPU; Megatron's own default mask is allocated on CUDA).

    Raises:
        HumanlineUsageError: ``seq_len`` is not a whole number ``>= 1``.
    """
    seq_len = whole_number("causal_mask", "seq_len", seq_len, "pass the sequence length T >= 1", low=1)
    return megatron_specs.causal_mask(seq_len, device)


def _check_layout(hf_model, tp, tp_rank, pp, pp_rank) -> None:
    """The sizes and ranks against megatron-core's parallel state and the model's heads and layers."""
    where, fix = "gpt_chunk_from_hf", "pass parallel_state's own sizes and ranks (see the example below)"
    from megatron.core import parallel_state as ps  # the `megatron` extra, loaded already by the imports above

    if not ps.model_parallel_is_initialized():
        raise refuse(where, "tp", "the size of an initialized tensor-parallel group", tp,
                              "call parallel_state.initialize_model_parallel(tp, pp) first (after the process group)")
    state = {"tp": ps.get_tensor_model_parallel_world_size(), "tp_rank": ps.get_tensor_model_parallel_rank(),
             "pp": ps.get_pipeline_model_parallel_world_size(), "pp_rank": ps.get_pipeline_model_parallel_rank()}
    given = {"tp": tp, "tp_rank": tp_rank, "pp": pp, "pp_rank": pp_rank}
    for name, value in given.items():
        if value != state[name]:
            raise refuse(where, name, f"{state[name]}, what megatron-core's parallel state says for this "
                                  "rank (a chunk of another rank's slice would train the wrong weights)", value,
                                  "tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel"
                                  "_rank(), pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_"
                                  "model_parallel_rank()")
    config = hf_model.config
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if heads % tp or kv_heads % tp:
        raise refuse(where, "tp", f"a divisor of the model's {heads} attention and {kv_heads} key-value "
                              "heads", tp, fix)
    if layers % pp:
        raise refuse(where, "pp", f"a divisor of the model's {layers} layers", pp, fix)


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

    Raises:
        HumanlineUsageError: ``hf_model`` is not a Hugging Face model; a size or rank is not a whole number, or is
            not what megatron-core's initialized parallel state says for this rank; ``tp`` does not divide the heads,
            or ``pp`` the layers; ``dtype`` is not a floating-point dtype.
    """
    where = "gpt_chunk_from_hf"
    fix = "pass AutoModelForCausalLM.from_pretrained(...) and parallel_state's sizes and ranks"
    if not isinstance(hf_model, torch.nn.Module) or not hasattr(hf_model, "config"):
        raise refuse(where, "hf_model", "a Hugging Face causal LM (an nn.Module with a config)", hf_model, fix)
    tp, pp = (whole_number(where, name, value, fix, low=1) for name, value in (("tp", tp), ("pp", pp)))
    tp_rank = whole_number(where, "tp_rank", tp_rank, fix, low=0, high=tp - 1)
    pp_rank = whole_number(where, "pp_rank", pp_rank, fix, low=0, high=pp - 1)
    dtype_arg(where, "dtype", dtype, ("float",), "pass torch.float32, torch.bfloat16 or torch.float16")
    _check_layout(hf_model, tp, tp_rank, pp, pp_rank)
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

