"""Humanline sampling's random draws: two-sided token rejection with Beta-distributed thresholds, every draw from a
caller's ``torch.Generator`` (reproducible), in log space (``Beta(0.01, 1)`` draws underflow float32)."""

from __future__ import annotations

import math
from typing import Optional

import torch

DEFAULT_GAMMA_P = 0.5
DEFAULT_GAMMA_R = 0.01
DEFAULT_BETA_P = 1.0
DEFAULT_BETA_R = 1.0


def _log_uniform(shape, generator, device) -> torch.Tensor:
    """``log V`` with ``V ~ Uniform(0, 1]`` in float64 (``1 - rand`` keeps ``log(0)`` out)."""
    return torch.log1p(-torch.rand(shape, generator=generator, device=device, dtype=torch.float64))


def _log_standard_gamma(shape, alpha: float, generator, device) -> torch.Tensor:
    """``log G`` with ``G ~ Gamma(alpha, 1)``, float64, every draw from ``generator``.

    Marsaglia-Tsang squeeze-free rejection (vectorised; redraws only the rejected entries) for
    ``alpha >= 1``; for ``alpha < 1`` the boost ``G = G' * V**(1/alpha)``, ``G' ~ Gamma(alpha + 1)``,
    taken in log space so that tiny shapes (``gamma_R = 0.01``) do not underflow.
    """
    if alpha < 1.0:
        return _log_standard_gamma(shape, alpha + 1.0, generator, device) + _log_uniform(
            shape, generator, device
        ) / alpha
    d = alpha - 1.0 / 3.0
    c = 1.0 / (9.0 * d) ** 0.5
    n = 1
    for size in shape:
        n *= int(size)
    out = torch.empty(n, dtype=torch.float64, device=device)
    pending = torch.arange(n, device=device)
    while pending.numel() > 0:
        k = pending.numel()
        x = torch.randn(k, generator=generator, device=device, dtype=torch.float64)
        log_u = _log_uniform((k,), generator, device)
        v = (1.0 + c * x) ** 3
        log_v = torch.log(v.clamp(min=torch.finfo(torch.float64).tiny))
        accept = (v > 0) & (log_u < 0.5 * x * x + d - d * v + d * log_v)
        out[pending[accept]] = math.log(d) + log_v[accept]
        pending = pending[~accept]
    return out.reshape(tuple(shape))


def log_beta_sample(
    shape, a: float, b: float, generator: Optional[torch.Generator] = None, device=None
) -> torch.Tensor:
    """``log u`` with ``u ~ Beta(a, b)``: float64, reproducible through ``generator``.

    ``torch.distributions.Beta`` takes no generator, so the draws are made here from uniforms and
    normals of ``generator``: for ``b == 1`` by the exact inverse CDF ``u = V**(1/a)``; otherwise as
    ``X / (X + Y)`` with ``X ~ Gamma(a)``, ``Y ~ Gamma(b)`` (Marsaglia-Tsang), all in log space
    (``Beta(0.01, 1)`` draws are below 1e-38 about 40% of the time).

    Args:
        shape: the draws' shape.
        a: the Beta parameters (``> 0``).
        b: the Beta parameters (``> 0``).
        generator: where the draws come from and live.
        device: where the draws come from and live.

    Returns:
        ``log u``, float64, of ``shape``.
    """
    if not (a > 0 and b > 0):
        raise ValueError(f"Beta parameters must be > 0, got ({a}, {b})")
    if b == 1.0:
        return _log_uniform(shape, generator, device) / a
    log_x = _log_standard_gamma(shape, float(a), generator, device)
    log_y = _log_standard_gamma(shape, float(b), generator, device)
    return log_x - torch.logaddexp(log_x, log_y)


def rejection_mask(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    mask: torch.Tensor,
    gamma_P: float = DEFAULT_GAMMA_P,
    gamma_R: float = DEFAULT_GAMMA_R,
    beta_P: float = DEFAULT_BETA_P,
    beta_R: float = DEFAULT_BETA_R,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Humanline two-sided token rejection; ``True`` = rejected. Fresh draws on every call.

    Per non-masked token, with ``M_R = max exp(lp_ref - lp_pol)`` and ``M_P = max exp(lp_pol - lp_ref)``
    over the non-masked tokens of the micro-batch, ``u_R ~ Beta(gamma_R, beta_R)`` and
    ``u_P ~ Beta(gamma_P, beta_P)``: reject if ``exp(lp_ref - lp_pol) < M_R * u_R`` OR
    ``exp(lp_pol - lp_ref) < M_P * u_P`` (compared in log space). Masked tokens are never rejected.
    ``u_R`` is drawn before ``u_P``, both from ``generator`` (the global RNG when ``None``).

    Args:
        policy_logps: per-token log-probs of the two models.
        ref_logps: per-token log-probs of the two models.
        mask: 1 on tokens that count.
        gamma_P: the Beta parameters (method defaults 0.5, 0.01, 1, 1).
        gamma_R: the Beta parameters (method defaults 0.5, 0.01, 1, 1).
        beta_P: the Beta parameters (method defaults 0.5, 0.01, 1, 1).
        beta_R: the Beta parameters (method defaults 0.5, 0.01, 1, 1).
        generator: where the draws come from.

    Returns:
        A boolean tensor, True on rejected tokens.

    Shape:
        all ``[B, T]``.
    """
    with torch.no_grad():
        mask_b = mask.bool()
        device = policy_logps.device
        log_ratio = (policy_logps.detach() - ref_logps.detach()).to(torch.float64)
        neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=device)
        # max over non-masked tokens; -inf (so nothing is rejected) when every token is masked
        log_M_R = torch.where(mask_b, -log_ratio, neg_inf).max()
        log_M_P = torch.where(mask_b, log_ratio, neg_inf).max()
        log_u_R = log_beta_sample(log_ratio.shape, gamma_R, beta_R, generator, device)
        log_u_P = log_beta_sample(log_ratio.shape, gamma_P, beta_P, generator, device)
        rejected_R = -log_ratio < log_M_R + log_u_R
        rejected_P = log_ratio < log_M_P + log_u_P
        return (rejected_R | rejected_P) & mask_b
