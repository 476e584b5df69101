"""The arithmetic under the public classes, as plain functions of tensors: ``torch.nn.functional`` to the
transforms' ``torch.nn``. A loop needs none of them (``ClipTransform``, ``SampleTransform`` and
``ParameterPairs.sync`` call them); they are public for a loop that composes its own objective.

* ``clip_log_ratio``: the clamp ``ClipTransform`` applies; ``unclamped_fraction``: its metric;
* ``rejection_mask``, ``log_beta_sample``: ``SampleTransform``'s draws;
* ``mix_into``: the elementwise copy or soft update ``ParameterPairs.sync`` applies to each shard;
* ``DEFAULT_LOG_EPS_P`` / ``DEFAULT_LOG_EPS_R``: the paper's bounds (-1.5, 1.5).

Each checks its arguments (``hl_core/humanline/contract.py``; a ``HumanlineUsageError`` names the argument and the
fix) and reads no tensor's values on the host. A non-finite value at a position the mask counts is never counted as
inside the bounds: ``unclamped_fraction`` is NaN then, so a guard that reads it stops the update.
"""

from __future__ import annotations

from typing import Optional

import torch

from .contract import clip_bounds, log_probs_and_mask, real_number, refuse, same_shape, tensor_arg, whole_number
from .sampling import (
    DEFAULT_BETA_P,
    DEFAULT_BETA_R,
    DEFAULT_GAMMA_P,
    DEFAULT_GAMMA_R,
    draw_log_beta,
    draw_rejections,
)

__all__ = ["DEFAULT_LOG_EPS_P", "DEFAULT_LOG_EPS_R", "clip_log_ratio", "log_beta_sample", "mix_into", "rejection_mask",
           "unclamped_fraction"]

DEFAULT_LOG_EPS_P = -1.5
DEFAULT_LOG_EPS_R = 1.5
_FIX_TENSOR = "pass per-token values [B, T] and the token mask [B, T] over the same positions"


def clip_log_ratio(
    log_ratio: torch.Tensor, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R
) -> torch.Tensor:
    """Humanline's asymmetric log-space clip, ``clamp(log_ratio, log_eps_P, log_eps_R)``.

    Args:
        log_ratio: per-token ``lp_pol - lp_ref`` (floating point).
        log_eps_P: lower bound, finite, ``<= 0``.
        log_eps_R: upper bound, finite, ``>= 0``.

    Returns:
        The clipped log-ratio: a token outside ``[log_eps_P, log_eps_R]`` takes the bound's value and gets zero
        gradient (plain ``clamp``); a NaN stays NaN. No mask here: ``ClipTransform`` zeroes masked positions.

    Shape:
        any; the output has the input's shape.
    """
    low, high = clip_bounds("clip_log_ratio", log_eps_P, log_eps_R)
    tensor_arg("clip_log_ratio", "log_ratio", log_ratio, None, ("float",), "pass a floating-point tensor")
    return clamp(log_ratio, low, high)


def clamp(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``clip_log_ratio`` on checked arguments."""
    return torch.clamp(log_ratio, min=low, max=high)


def fraction(count: torch.Tensor, total: torch.Tensor, empty: float) -> torch.Tensor:
    """``count / total`` in float64 on the device (``empty`` where ``total`` is 0): the same double as Python's
    ``float(count) / int(total)``, without reading either on the host."""
    total = total.to(torch.float64)
    return torch.where(total > 0, count.to(torch.float64) / total.clamp(min=1), torch.full_like(total, empty))


def nan_if(flag: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value``, or NaN where ``flag`` (a bool tensor) is set: a metric a non-finite input makes undefined."""
    return torch.where(flag, torch.full_like(value, float("nan")), value)


def counted_nonfinite(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """Whether any position ``counted`` holds a non-finite value (a 0-dim bool tensor, on the device)."""
    return (counted & ~torch.isfinite(values)).any()


def unclamped_fraction(
    log_ratio: torch.Tensor, mask: torch.Tensor, log_eps_P: float, log_eps_R: float
) -> torch.Tensor:
    """Fraction of counted tokens strictly inside ``(log_eps_P, log_eps_R)``: the tokens clipping leaves alone.

    Args:
        log_ratio: per-token log-ratios (floating point). Masked positions may hold anything.
        mask: nonzero (``True``, 1) on tokens that count, 0 elsewhere; bool, integer or floating point.
        log_eps_P: lower bound, finite, ``<= 0``.
        log_eps_R: upper bound, finite, ``>= 0``.

    Returns:
        A 0-dim float64 tensor on ``log_ratio``'s device; 1.0 when no token counts; NaN when a counted token's
        log-ratio is NaN or infinite (it is neither inside nor clipped).

    Shape:
        ``log_ratio`` and ``mask``: one shape (no broadcasting), e.g. ``[B, T]``.
    """
    low, high = clip_bounds("unclamped_fraction", log_eps_P, log_eps_R)
    tensor_arg("unclamped_fraction", "log_ratio", log_ratio, None, ("float",), _FIX_TENSOR)
    tensor_arg("unclamped_fraction", "mask", mask, None, ("bool", "int", "float"), _FIX_TENSOR)
    same_shape("unclamped_fraction", "mask", mask, "log_ratio", log_ratio, _FIX_TENSOR)
    return inside_fraction(log_ratio, mask != 0, low, high)


def inside_fraction(log_ratio: torch.Tensor, counted: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """``unclamped_fraction`` on checked arguments (``counted``: a bool mask)."""
    inside = (log_ratio > low) & (log_ratio < high) & counted
    return nan_if(counted_nonfinite(log_ratio, counted), fraction(inside.sum(), counted.sum(), 1.0))


def mix_into(reference: torch.Tensor, policy: torch.Tensor, mix: float) -> None:
    """In place, elementwise: ``reference = mix * policy + (1 - mix) * reference``, so any shard of a parameter
    mixes as the whole would.

    ``mix == 1`` is a plain copy (bit for bit; into another dtype it rounds once); otherwise ``torch.lerp``, which
    rounds once in the tensor's dtype (``mul_`` then ``add_`` would round twice: in bf16, a drift of up to an ulp of
    the weight per sync).

    Args:
        reference: the tensor written (floating point).
        policy: the tensor read: another tensor of ``reference``'s shape (and dtype, when ``mix < 1``).
        mix: in ``(0, 1]``.

    Shape:
        ``reference`` and ``policy`` alike.
    """
    where, fix = "mix_into", "pass two distinct floating-point tensors of one shape, and mix in (0, 1]"
    mix = real_number(where, "mix", mix, fix, low=0.0, high=1.0, low_open=True)
    tensor_arg(where, "reference", reference, None, ("float",), fix)
    tensor_arg(where, "policy", policy, None, ("float",), fix)
    if tuple(policy.shape) != tuple(reference.shape) or (mix != 1.0 and policy.dtype != reference.dtype):
        raise refuse(where, "policy", f"of `reference`'s shape {list(reference.shape)}"
                              + (f" and dtype {reference.dtype}" if mix != 1.0 else ""), policy, fix)
    if policy is reference:
        raise refuse(where, "policy", "another tensor than `reference`", policy, fix)
    mix_unchecked(reference, policy, mix)


def mix_unchecked(reference: torch.Tensor, policy: torch.Tensor, mix: float) -> None:
    """``mix_into`` on checked arguments."""
    if mix == 1.0:
        reference.copy_(policy)
    else:
        reference.lerp_(policy, mix)


def log_beta_sample(shape, a: float, b: float, generator: Optional[torch.Generator] = None,
                    device=None) -> torch.Tensor:
    """``log u`` with ``u ~ Beta(a, b)``: float64, reproducible through ``generator``.

    ``torch.distributions.Beta`` takes no generator, so the draws are made here from uniforms and normals of
    ``generator``: for ``b == 1`` by the exact inverse CDF ``u = V**(1/a)``; otherwise as ``X / (X + Y)`` with
    ``X ~ Gamma(a)``, ``Y ~ Gamma(b)`` (Marsaglia-Tsang), all in log space (``Beta(0.01, 1)`` draws are below 1e-38
    about 40% of the time).

    Args:
        shape: the draws' shape: a sequence of whole numbers ``>= 0``.
        a: the Beta parameters: finite, ``> 0``.
        b: the Beta parameters: finite, ``> 0``.
        generator: where the draws come from (a ``torch.Generator``; the global one when None).
        device: where the draws live (default: the generator's device).

    Returns:
        ``log u``, float64, of ``shape``.
    """
    where = "log_beta_sample"
    fix = "pass a shape of whole numbers >= 0, finite a > 0 and b > 0, and a torch.Generator on the draws' device"
    shape = _shape(where, shape, fix)
    a = real_number(where, "a", a, fix, low=0.0, low_open=True)
    b = real_number(where, "b", b, fix, low=0.0, low_open=True)
    device = _generator_device(where, generator, device, fix)
    return draw_log_beta(shape, a, b, generator, device)


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

    Per counted token, with ``M_R = max exp(lp_ref - lp_pol)`` and ``M_P = max exp(lp_pol - lp_ref)`` over the
    counted tokens of the micro-batch, ``u_R ~ Beta(gamma_R, beta_R)`` and ``u_P ~ Beta(gamma_P, beta_P)``: reject if
    ``exp(lp_ref - lp_pol) < M_R * u_R`` OR ``exp(lp_pol - lp_ref) < M_P * u_P`` (compared in log space). Masked
    tokens, and tokens whose log-ratio is not finite, are never rejected and do not enter ``M``. ``u_R`` is drawn
    before ``u_P``, both from ``generator``, one draw per position whatever the mask.

    Args:
        policy_logps: per-token log-probs of the policy (floating point, ``[B, T]``).
        ref_logps: per-token log-probs of the reference (``policy_logps``' shape and device).
        mask: nonzero on tokens that count (``policy_logps``' shape and device).
        gamma_P: the Beta parameters, finite, ``> 0`` (method defaults 0.5, 0.01, 1, 1).
        gamma_R: the Beta parameters, finite, ``> 0`` (method defaults 0.5, 0.01, 1, 1).
        beta_P: the Beta parameters, finite, ``> 0`` (method defaults 0.5, 0.01, 1, 1).
        beta_R: the Beta parameters, finite, ``> 0`` (method defaults 0.5, 0.01, 1, 1).
        generator: where the draws come from: a ``torch.Generator`` on the log-probs' device (the global one when
            None).

    Returns:
        A boolean tensor, True on rejected tokens.

    Shape:
        all ``[B, T]``; ``B = 0`` gives an empty result.
    """
    where = "rejection_mask"
    log_probs_and_mask(where, policy_logps, ref_logps, mask)
    params = beta_parameters(where, gamma_P, gamma_R, beta_P, beta_R)
    _generator_device(where, generator, policy_logps.device, "pass a torch.Generator on the log-probs' device")
    return draw_rejections(policy_logps, ref_logps, mask != 0, *params, generator=generator)


def beta_parameters(where: str, gamma_P, gamma_R, beta_P, beta_R) -> tuple:
    """The four Beta parameters, each finite and ``> 0`` (an infinite one would never finish its draws)."""
    fix = "pass finite Beta parameters > 0 (the method's defaults: gamma_P 0.5, gamma_R 0.01, beta_P 1, beta_R 1)"
    return tuple(real_number(where, name, value, fix, low=0.0, low_open=True) for name, value in
                 (("gamma_P", gamma_P), ("gamma_R", gamma_R), ("beta_P", beta_P), ("beta_R", beta_R)))


def _shape(where: str, shape, fix: str) -> tuple:
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise refuse(where, "shape", "a sequence of whole numbers >= 0", shape, fix)
    return tuple(whole_number(where, "shape", size, fix, low=0) for size in shape)


def _generator_device(where: str, generator, device, fix: str) -> torch.device:
    """The device the draws live on; a generator elsewhere is refused."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise refuse(where, "generator", "a torch.Generator or None", generator, fix)
    try:
        device = torch.device(device) if device is not None else (
            generator.device if generator is not None else torch.device("cpu"))
    except (RuntimeError, TypeError):
        raise refuse(where, "device", "a torch.device, a device string or None", device, fix) from None
    if generator is not None and generator.device.type != device.type:
        raise refuse(where, "generator", f"a torch.Generator on {device}", generator.device, fix)
    return device
