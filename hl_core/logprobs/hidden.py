"""Per-token log-probs from the last hidden states and the output layer, never holding the ``[B, T, V]`` logits.

``hidden_token_logps(hidden, weight, labels)[n] = log_softmax(z_n)[labels[n]]`` with
``z_n = cap * tanh((hidden[n] @ weight.T + bias) / cap) / temperature`` (Gemma 2's final-logit soft-cap ``cap``;
without one, ``z_n = (hidden[n] @ weight.T + bias) / temperature``), computed a block of tokens at a time: at
most one ``[block, V]`` float32 block of logits exists in the forward and in the backward, which recomputes each
block from the saved hidden states and the per-token log-sum-exp instead of keeping any; a block is a fixed small
share of the whole (``block_rows``). Only tokens with a valid label are computed (padding and positions without a
next token cost nothing); their positions come from the host-side batch (``valid_positions``), so the device is
never read. Without autograd (the reference's forward, the look-ahead store, the cache, evaluation) only the forward
runs: no gradient buffer, nothing saved.

Two implementations of one function:

* ``_BlockwiseLogps`` (plain PyTorch): every device; the reference the tests hold the rest to.
* Liger-Kernel's fused linear cross-entropy (``reduction="none"``, its soft-cap; the temperature folded into the
  hidden states and the bias, which is exact only without a soft-cap) on a CUDA device when ``liger-kernel`` is
  installed, for forwards that need a gradient; its per-token loss is ``-logp``. Its backward is its own, fed the
  per-token upstream gradient. A no-grad forward never calls it: its forward allocates an input-gradient buffer and
  reads a token count on the host even when asked for no gradients.

``logps_from_hidden`` makes a Hugging Face causal LM (or a PEFT wrapper of one) return these log-probs from
its forward instead of logits, so the call still goes through the training engine's forward (DeepSpeed's backward
hooks) and the output layer is still called as a module (ZeRO-3 gathers its weight for the forward and again for
the backward, and releases it after each).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import RecipeError
from .logits import next_token_labels, to_prefix_layout

# Imports inside functions: liger-kernel is optional (GPU only); it is looked up once, on the first CUDA call.

_LIGER_FN = []  # [function or None], filled on first use


def hidden_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                       bias: Optional[torch.Tensor] = None,
                       temperature: float = 1.0, softcap: Optional[float] = None, block_tokens: int = 256,
                       backend: str = "auto", index: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``hidden [..., H]``, ``weight [V, H]``, ``labels [...]`` -> float32 log-probs ``[...]``; a label outside
    ``[0, V)`` gives 0 and no gradient. Equal to ``log_softmax(z).gather(labels)`` over the full logits ``z`` to
    float32 rounding. ``block_tokens``: the most tokens per block (``block_rows``). ``backend``: ``auto`` (Liger
    on CUDA when it applies, else ``torch``), ``torch``, or ``liger`` (Liger on any device, when installed and it
    applies; for tests). ``index``: the flat positions of the valid labels, ascending, on ``hidden``'s device, when
    the caller has them (built on the host from the batch: ``valid_positions``); without it they are found with
    ``nonzero``, a read of the device on a GPU."""
    vocab, width = weight.shape
    flat_labels = labels.reshape(-1)
    if index is None:
        index = valid_positions(flat_labels, vocab)
    picked = hidden.reshape(-1, width).index_select(0, index)  # [N, H]: the backward scatters into hidden's grad
    targets = flat_labels.index_select(0, index)
    rows = block_rows(picked.shape[0], vocab, block_tokens)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (picked, weight, bias))
    liger = _liger_function() if needs_grad and (backend == "liger" or (backend == "auto" and picked.is_cuda)) else None
    if not needs_grad:  # only the forward: no autograd node, no saved tensors, no gradient buffers
        values = _blockwise_forward(picked, weight, bias, targets, rows, float(temperature),
                                    None if softcap is None else float(softcap))[0]
    elif liger is not None and (softcap is None or temperature == 1.0):
        if temperature != 1.0:  # (h W^T + b) / t = (h / t) W^T + b / t: exact without a soft-cap between them
            picked, bias = picked / temperature, (bias / temperature if bias is not None else None)
        values = _LigerLogps.apply(picked, weight, bias, targets, softcap, liger)
    else:
        values = _BlockwiseLogps.apply(picked, weight, bias, targets, rows, float(temperature),
                                       None if softcap is None else float(softcap))
    out = values.new_zeros(flat_labels.shape[0]).index_copy(0, index, values)
    return out.reshape(labels.shape)


def valid_positions(labels: torch.Tensor, vocab: Optional[int] = None) -> torch.Tensor:
    """The flat positions of ``labels`` in ``[0, vocab)`` (``>= 0`` without ``vocab``), ascending: ``[N]``. Built
    where ``labels`` lives; on the host from the collated batch it costs the device nothing."""
    flat = labels.reshape(-1)
    valid = flat >= 0 if vocab is None else (flat >= 0) & (flat < vocab)
    return valid.nonzero().squeeze(-1)


# A block of float32 logits [rows, V] holds at most 1/BLOCK_SHARE of the whole [N, V] that the logits path keeps (so
# the fused path's working memory stays a fixed small share of it), or MIN_BLOCK_LOGITS, whichever is larger (small
# inputs: one block of 16 MiB, no needless cutting), and never more than `block_tokens` rows. A forward or backward
# then runs in at most about BLOCK_SHARE blocks until the rows cap binds: few, large products (on a GPU, each block's
# handful of kernels is worth launching; fixed 256-token blocks cut into 16,384-column slices made an 8,192-token
# micro-batch 256 launch-bound pieces).
BLOCK_SHARE = 64
MIN_BLOCK_LOGITS = 2 ** 22


def block_rows(count: int, vocab: int, block_tokens: int) -> int:
    """Tokens per block for ``count`` tokens over a vocabulary of ``vocab`` (see `BLOCK_SHARE`)."""
    budget = max(count * vocab // BLOCK_SHARE, MIN_BLOCK_LOGITS)
    return max(1, min(int(block_tokens), budget // max(1, vocab)))


def _block_logits(hidden: torch.Tensor, weight, bias, temperature: float, softcap: Optional[float]):
    """``(z, capped)``: the float32 logits of one block divided by the temperature, and ``tanh(s / cap)`` (for the
    soft-cap's derivative; None without one). The product runs in the weight's dtype, as the output layer does; the
    rest in float32 (float64 for float64 weights, as in the tests)."""
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    capped = None
    if softcap is not None:
        capped = torch.tanh(z.div_(softcap))
        z = capped * softcap
    if temperature != 1.0:
        z.div_(temperature)
    return z, capped


@torch.no_grad()
def _blockwise_forward(hidden, weight, bias, labels, block: int, temperature: float, softcap: Optional[float]):
    """``(logp, lse)`` per token: ``z[y] - logsumexp(z)``, ``block`` tokens at a time (the exponentials in place,
    so one ``[block, V]`` float32 block exists)."""
    count = hidden.shape[0]
    work = torch.promote_types(weight.dtype, torch.float32)
    out = torch.empty(count, dtype=torch.float32, device=hidden.device)
    lse = torch.empty(count, dtype=work, device=hidden.device)
    for start in range(0, count, block):
        end = min(start + block, count)
        z, _ = _block_logits(hidden[start:end], weight, bias, temperature, softcap)
        picked = z.gather(-1, labels[start:end, None])[:, 0]
        peak = z.amax(-1)
        lse[start:end] = peak + z.sub_(peak[:, None]).exp_().sum(-1).log_()
        out[start:end] = picked - lse[start:end]
        del z
    return out, lse


class _BlockwiseLogps(torch.autograd.Function):
    """``logp[n] = z[n, y_n] - logsumexp(z[n])`` over blocks of ``block`` tokens.

    Backward, per block: ``dlogp/dz = 1[v = y] - softmax(z)`` (from the saved log-sum-exp), times ``1 / temperature``
    and the soft-cap's ``1 - tanh^2``, gives the block's logit gradient ``G``; then ``grad_hidden = G @ W``,
    ``grad_W += G.T @ hidden``, ``grad_bias += G.sum(0)``, in the weight's dtype (as the output layer's own backward
    produces them)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, block: int, temperature: float, softcap: Optional[float]):
        out, lse = _blockwise_forward(hidden, weight, bias, labels, block, temperature, softcap)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.block, ctx.temperature, ctx.softcap = block, temperature, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros_like(bias) if need_bias else None
        grad_out = grad_out.to(lse.dtype)
        for start in range(0, hidden.shape[0], ctx.block):
            end = min(start + ctx.block, hidden.shape[0])
            g, rows = grad_out[start:end, None], hidden[start:end]
            z, capped = _block_logits(rows, weight, bias, ctx.temperature, ctx.softcap)
            grad = z.sub_(lse[start:end, None]).exp_().mul_(-g)  # -softmax * g
            grad.scatter_add_(-1, labels[start:end, None], g)  # + g at y
            if ctx.temperature != 1.0:
                grad.div_(ctx.temperature)
            if capped is not None:
                grad.mul_(1.0 - capped.square_())
            grad = grad.to(weight.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad @ weight
            if need_weight:
                grad_weight.addmm_(grad.t(), rows)
            if need_bias:
                grad_bias.add_(grad.sum(0))
            del grad, z, capped
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def _liger_function():
    """Liger-Kernel's ``fused_linear_cross_entropy_forward`` when installed and able to take a per-token upstream
    gradient (``token_grad_output``, liger-kernel >= 0.6), else None."""
    if not _LIGER_FN:
        fn = None
        if importlib.util.find_spec("liger_kernel") is not None:
            from liger_kernel.ops import fused_linear_cross_entropy as liger_ops  # optional, GPU only

            fn = getattr(liger_ops, "fused_linear_cross_entropy_forward", None)
            wanted = {"token_grad_output", "compute_gradients", "weight_requires_grad", "softcap", "reduction"}
            if fn is not None and not wanted <= set(inspect.signature(fn).parameters):
                fn = None
        _LIGER_FN.append(fn)
    return _LIGER_FN[0]


class _LigerLogps(torch.autograd.Function):
    """Liger's fused linear cross-entropy with no reduction: ``logp = -loss`` per token; the backward recomputes
    its blocks with the per-token upstream gradient. The weight is saved as the parameter itself (not a detached
    copy), so under ZeRO-3 the backward reads it as gathered again for the output layer's backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, softcap, fn):
        loss = fn(_input=hidden, weight=weight, target=labels, bias=bias, reduction="none", softcap=softcap,
                  compute_gradients=False)[0]
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.softcap, ctx.fn = softcap, fn
        return -loss.float()

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, labels = ctx.saved_tensors
        grads = ctx.fn(_input=hidden, weight=weight, target=labels, bias=bias, reduction="none", softcap=ctx.softcap,
                       token_grad_output=-grad_out.float().contiguous(), compute_gradients=True,
                       weight_requires_grad=ctx.needs_input_grad[1])[-3:]
        grad_hidden, grad_weight, grad_bias = grads
        return (grad_hidden if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
                grad_bias if ctx.needs_input_grad[2] else None, None, None, None)


# ------------------------------------------------------------------------------------------ the model side
def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside ``model`` (itself, or the base model of a PEFT wrapper)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_layer(model: torch.nn.Module) -> torch.nn.Linear:
    """The causal LM's output layer; a ``RecipeError`` unless it is a plain ``nn.Linear`` (e.g. a LoRA-wrapped head)."""
    head = causal_lm(model).get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        raise RecipeError(
            f"`train.fused_logprobs: true` multiplies the last hidden states by the output layer's weight itself, but "
            f"this model's output layer is a `{type(head).__name__}`, not a plain linear layer (an adapter on it, e.g. "
            "`lm_head` in `model.lora.target_modules`?). Fix: keep adapters off the output layer, or "
            "`train.fused_logprobs=false`.")
    return head


@contextlib.contextmanager
def logps_from_hidden(model: torch.nn.Module, labels: torch.Tensor, temperature: float = 1.0, block_tokens: int = 256,
                      index: Optional[torch.Tensor] = None):
    """While active, ``model(input_ids=..., attention_mask=..., position_ids=...)`` returns the float32 log-probs
    ``[B, T]`` of ``labels`` (``-1``: 0, not computed) from the last hidden states, with the sampling temperature
    and the config's ``final_logit_softcapping``, instead of logits. The decoder runs as usual (its attention mask,
    packed positions, gradient checkpointing, compiled layers); only the causal LM's own forward and its output
    layer's are replaced, on the instances, and restored on exit. ``index``: ``valid_positions`` of ``labels``,
    on their device (found there when not given)."""
    lm = causal_lm(model)
    head, decoder = output_layer(lm), lm.get_decoder()
    softcap = getattr(lm.config, "final_logit_softcapping", None)

    def head_forward(hidden):
        return hidden_token_logps(hidden, head.weight, labels, bias=head.bias, temperature=temperature, softcap=softcap,
                                  block_tokens=block_tokens, index=index)

    def lm_forward(input_ids=None, attention_mask=None, position_ids=None, **_):
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False).last_hidden_state
        return head(hidden)  # a module call: ZeRO-3's hooks gather the weight for the forward and the backward

    saved = [(module, module.__dict__.get("forward")) for module in (lm, head)]
    lm.forward, head.forward = lm_forward, head_forward
    try:
        yield
    finally:
        for module, own in saved:
            if own is None:
                del module.forward
            else:
                module.forward = own


def fused_sequence_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                               block_tokens: int = 256, temperature: float = 1.0,
                               module: Optional[torch.nn.Module] = None,
                               device: Optional[torch.device] = None) -> torch.Tensor:
    """Per-token log-probs from the last hidden states and the output layer, never holding the ``[B, T, V]`` logits
    (our trainer's ``train.fused_logprobs``): ``prefix_token_logps``'s values, to float32 rounding.

    ``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1``; 0 at position 0 and wherever
    ``attention_mask`` is 0. The model is called once (through ``model``, so a training engine's hooks run) with its
    causal LM's forward and output layer swapped, for the call only, for a blockwise log-softmax of the labels.
    The output layer must be a plain ``nn.Linear`` (no adapter on it).

    Args:
        model: what is called: a Hugging Face causal LM, a PEFT wrapper of one, or a training engine holding one.
        input_ids: the token ids (may be the host-side batch: labels and their valid positions are built there and
            moved to ``device`` with them, without waiting).
        attention_mask: 1 on real tokens, 0 on padding.
        block_tokens: the most tokens per float32 block of logits.
        temperature: the logits are divided by it first.
        module: the causal LM inside ``model`` (default: ``model``).
        device: where the forward runs (default: where ``input_ids`` are).

    Returns:
        float32 log-probs, differentiable with respect to the model's parameters.

    Shape:
        ``input_ids``, ``attention_mask`` and the output: ``[B, T]`` (DPO: chosen rows first, then rejected).
    """
    has_next = torch.cat([attention_mask[:, 1:], attention_mask.new_zeros(attention_mask.shape[0], 1)], dim=1).bool()
    labels = next_token_labels(input_ids, has_next & attention_mask.bool())
    index = valid_positions(labels)
    device = device if device is not None else input_ids.device
    input_ids, attention_mask, labels, index = (t.to(device, non_blocking=True)
                                                for t in (input_ids, attention_mask, labels, index))
    with logps_from_hidden(module if module is not None else model, labels, temperature, block_tokens, index):
        next_logps = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return to_prefix_layout(next_logps)
