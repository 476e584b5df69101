"""Humanline sampling's random draws: two-sided token rejection with Beta-distributed thresholds, every draw from a
caller's ``torch.Generator`` (reproducible), in log space (``Beta(0.01, 1)`` draws underflow float32).

The functions here take checked arguments; the public ones, which check them, are ``log_beta_sample`` and
``rejection_mask`` in ``hl_core.humanline.functional``."""

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


def draw_log_beta(shape, a: float, b: float, generator: Optional[torch.Generator] = None,
                  device=None) -> torch.Tensor:
    """``log u`` with ``u ~ Beta(a, b)`` (``hl_core.humanline.functional.log_beta_sample`` on checked arguments:
    ``a`` and ``b`` finite and ``> 0``, else the Gamma draws would never finish)."""
    if b == 1.0:
        return _log_uniform(shape, generator, device) / a
    log_x = _log_standard_gamma(shape, float(a), generator, device)
    log_y = _log_standard_gamma(shape, float(b), generator, device)
    return log_x - torch.logaddexp(log_x, log_y)


def _masked_max(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """The largest counted value (float64, 0-dim); -inf when nothing counts, an empty batch included."""
    neg_inf = torch.full((1,), float("-inf"), dtype=values.dtype, device=values.device)
    return torch.cat([torch.where(counted, values, neg_inf).reshape(-1), neg_inf]).max()


def draw_rejections(policy_logps: torch.Tensor, ref_logps: torch.Tensor, counted: torch.Tensor, gamma_P: float,
                    gamma_R: float, beta_P: float, beta_R: float,
                    generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``hl_core.humanline.functional.rejection_mask`` on checked arguments (``counted``: a bool mask). Positions
    whose log-ratio is not finite count for neither ``M`` nor a rejection; the draws are one per position whatever
    the mask, so the generator advances alike for any values."""
    with torch.no_grad():
        device = policy_logps.device
        log_ratio = (policy_logps.detach() - ref_logps.detach()).to(torch.float64)
        counted = counted & torch.isfinite(log_ratio)
        log_M_R = _masked_max(-log_ratio, counted)
        log_M_P = _masked_max(log_ratio, counted)
        log_u_R = draw_log_beta(log_ratio.shape, gamma_R, beta_R, generator, device)
        log_u_P = draw_log_beta(log_ratio.shape, gamma_P, beta_P, generator, device)
        rejected_R = -log_ratio < log_M_R + log_u_R
        rejected_P = log_ratio < log_M_P + log_u_P
        return (rejected_R | rejected_P) & counted
