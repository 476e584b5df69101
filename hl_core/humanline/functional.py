"""The arithmetic under the public classes, as plain functions of tensors: ``torch.nn.functional`` to the
transforms' ``torch.nn``. A loop needs none of them (``ClipTransform``, ``SampleTransform`` and
``ParameterPairs.sync`` call them); they are public for a loop that composes its own objective.

* ``clip_log_ratio``: the clamp ``ClipTransform`` applies; ``unclamped_fraction``: its metric;
* ``rejection_mask``, ``log_beta_sample``: ``SampleTransform``'s draws;
* ``mix_into``: the elementwise copy or soft update ``ParameterPairs.sync`` applies to each shard;
* ``DEFAULT_LOG_EPS_P`` / ``DEFAULT_LOG_EPS_R``: the paper's bounds (-1.5, 1.5).
"""

from __future__ import annotations

import torch

from .sampling import log_beta_sample, rejection_mask

__all__ = ["DEFAULT_LOG_EPS_P", "DEFAULT_LOG_EPS_R", "clip_log_ratio", "log_beta_sample", "mix_into", "rejection_mask",
           "unclamped_fraction"]

DEFAULT_LOG_EPS_P = -1.5
DEFAULT_LOG_EPS_R = 1.5

def check_bounds(log_eps_P: float, log_eps_R: float) -> None:
    """A ``ValueError`` unless ``log_eps_P <= 0 <= log_eps_R``."""
    if not log_eps_P <= 0.0 <= log_eps_R:
        raise ValueError(f"need log_eps_P <= 0 <= log_eps_R, got ({log_eps_P}, {log_eps_R})")


def clip_log_ratio(
    log_ratio: torch.Tensor, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R
) -> torch.Tensor:
    """Humanline's asymmetric log-space clip, ``clamp(log_ratio, log_eps_P, log_eps_R)``.

    Args:
        log_ratio: per-token ``lp_pol - lp_ref``.
        log_eps_P: lower bound (``<= 0``).
        log_eps_R: upper bound (``>= 0``).

    Returns:
        The clipped log-ratio: a token outside ``[log_eps_P, log_eps_R]`` takes the bound's value and gets zero
        gradient (plain ``clamp``).

    Shape:
        any; the output has the input's shape.
    """
    check_bounds(log_eps_P, log_eps_R)
    return torch.clamp(log_ratio, min=log_eps_P, max=log_eps_R)


def fraction(count: torch.Tensor, total: torch.Tensor, empty: float) -> torch.Tensor:
    """``count / total`` in float64 on the device (``empty`` where ``total`` is 0): the same double as Python's
    ``float(count) / int(total)``, without reading either on the host."""
    total = total.to(torch.float64)
    return torch.where(total > 0, count.to(torch.float64) / total.clamp(min=1), torch.full_like(total, empty))


def unclamped_fraction(
    log_ratio: torch.Tensor, mask: torch.Tensor, log_eps_P: float, log_eps_R: float
) -> torch.Tensor:
    """Fraction of non-masked tokens strictly inside ``(log_eps_P, log_eps_R)``: the tokens clipping leaves alone.

    Args:
        log_ratio: per-token log-ratios.
        mask: 1 on tokens that count, 0 elsewhere.
        log_eps_P: lower bound.
        log_eps_R: upper bound.

    Returns:
        A 0-dim float64 tensor on ``log_ratio``'s device; 1.0 when no token counts.

    Shape:
        ``log_ratio`` and ``mask``: ``[B, T]``.
    """
    mask = mask.bool()
    inside = (log_ratio > log_eps_P) & (log_ratio < log_eps_R) & mask
    return fraction(inside.sum(), mask.sum(), 1.0)


def mix_into(reference: torch.Tensor, policy: torch.Tensor, mix: float) -> None:
    """In place, elementwise: ``reference = mix * policy + (1 - mix) * reference``, so any shard of a parameter
    mixes as the whole would.

    ``mix == 1`` is a plain copy (bit for bit); otherwise ``torch.lerp``, which rounds once in the tensor's dtype
    (``mul_`` then ``add_`` would round twice: in bf16, a drift of up to an ulp of the weight per sync).

    Args:
        reference: the tensor written.
        policy: the tensor read.
        mix: in ``(0, 1]``.

    Shape:
        ``reference`` and ``policy`` alike.
    """
    if mix == 1.0:
        reference.copy_(policy)
    else:
        reference.lerp_(policy, mix)
