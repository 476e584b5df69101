"""Megatron token log-probs: vocab-parallel (full-vocabulary logits are never gathered) and, for
pipeline parallel, through megatron-core's 1F1B schedule (forward-only, or forward+backward with a
surrogate loss whose parameter gradient is the trainer's; see ``megatron_engine``)."""

from __future__ import annotations

from typing import Optional

import torch

from ..logprobs import vocab_parallel_logps

# Imports inside functions: megatron-core is an optional extra; it loads with a megatron engine.


def vocab_parallel_token_logps(logits, input_ids, chunk_size: int = 128, temperature: float = 1.0, transform=None):
    """``[N, T, V/tp]`` vocab-parallel logits -> ``[N, T]`` float32 log-probs, ``out[:, 0] = 0``,
    ``out[:, t] = log p(input_ids[:, t] | input_ids[:, :t])`` over the full vocabulary.

    The max, the sum of exponentials and the target logit are all-reduced over the TP group, a sequence
    chunk at a time (``hl_core.logprobs.vocab_parallel_logps``: autograd keeps the logits and one float32
    log-sum-exp per token, and the backward writes the gradient slice by slice). With an element-wise
    ``transform`` of the logits (Gemma 2's soft-capping), megatron-core's vocab-parallel cross entropy is
    used instead, which keeps a float32 softmax of every chunk for its backward.
    """
    from megatron.core import parallel_state as ps

    if transform is None:
        labels = torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), -1)], dim=1)
        tp = ps.get_tensor_model_parallel_world_size()
        local = logits.shape[-1]
        group = ps.get_tensor_model_parallel_group() if tp > 1 else None
        out = vocab_parallel_logps(logits, labels, chunk_size, temperature, group,
                                   ps.get_tensor_model_parallel_rank() * local, local * tp)
        return torch.cat([out.new_zeros(out.shape[0], 1), out[:, :-1]], dim=1)
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    labels = input_ids[:, 1:]
    steps = labels.shape[1]
    pieces = []
    for start in range(0, steps, chunk_size):
        end = min(start + chunk_size, steps)
        chunk = transform(logits[:, start:end].to(torch.float32, copy=True))  # the kernel works in place
        if temperature != 1.0:
            chunk = chunk / temperature
        pieces.append(-vocab_parallel_cross_entropy(chunk, labels[:, start:end]))
    shifted = torch.cat(pieces, dim=1) if pieces else logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat([shifted.new_zeros(shifted.shape[0], 1), shifted], dim=1)


def pipeline_token_logps(model, input_ids, *, num_microbatches: int, temperature: float = 1.0, chunk_size: int = 128,
                         transform=None, attention_mask=None, grad_logps: Optional[torch.Tensor] = None):
    """Megatron's pipeline schedule (1F1B) over one batch of ``input_ids`` split into ``num_microbatches``.

    Forward-only (``grad_logps is None``): returns the ``[N, T]`` log-probs, broadcast from the last
    stage to every rank of the pipeline group. Otherwise runs forward+backward with the surrogate loss
    ``sum(logps * grad_logps)`` on the last stage (its parameter gradient is ``sum_t g_t dlogp_t/dtheta``);
    gradients accumulate into the parameters and ``None`` is returned.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_only = grad_logps is None
    rows, seq_len = input_ids.shape
    if rows % num_microbatches:
        raise ValueError(f"{rows} rows do not split into {num_microbatches} pipeline micro-batches")
    mbs = rows // num_microbatches
    device = input_ids.device
    pieces = [
        {"ids": input_ids[i * mbs : (i + 1) * mbs],
         "grad": None if forward_only else grad_logps[i * mbs : (i + 1) * mbs].to(device)}
        for i in range(num_microbatches)
    ]
    position_ids = torch.arange(seq_len, device=device)[None].expand(mbs, -1)

    def forward_step(data_iterator, chunk_model):
        piece = next(data_iterator)
        output = chunk_model(piece["ids"], position_ids, attention_mask)

        def loss_func(logits):
            logps = vocab_parallel_token_logps(logits, piece["ids"], chunk_size, temperature, transform)
            if forward_only:
                return logps.sum() * 0.0, {"logps": logps.detach()}
            # the schedule divides each micro-batch's loss by their number: undo it (the caller scaled already)
            return (logps * piece["grad"]).sum() * num_microbatches, {}

        return output, loss_func

    with torch.set_grad_enabled(not forward_only):
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(pieces), model=[model],
            num_microbatches=num_microbatches, seq_length=seq_len, micro_batch_size=mbs, forward_only=forward_only,
        )
    if not forward_only:
        return None
    if ps.is_pipeline_last_stage():
        logps = torch.cat([o["logps"] for o in outputs], dim=0)
    else:
        logps = torch.empty(rows, seq_len, dtype=torch.float32, device=device)
    torch.distributed.broadcast(logps, src=ps.get_pipeline_model_parallel_last_rank(),
                                group=ps.get_pipeline_model_parallel_group())
    return logps
