"""Per-token log-ratio transforms: what every objective receives in place of ``lp_pol - lp_ref``.

A transform is called as ``transform(policy_logps, ref_logps, mask) -> (log_ratios, metrics)``. Its metrics are
0-dim float64 tensors on the log-probs' device: reading them (``float(v)``) is the caller's choice, so a loop that
keeps them on the device until it logs pays no host synchronisation per call.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from .functional import (
    DEFAULT_LOG_EPS_P,
    DEFAULT_LOG_EPS_R,
    check_bounds,
    clip_log_ratio,
    fraction,
    unclamped_fraction,
)
from .sampling import DEFAULT_BETA_P, DEFAULT_BETA_R, DEFAULT_GAMMA_P, DEFAULT_GAMMA_R, rejection_mask

Metrics = Dict[str, torch.Tensor]  # a transform's diagnostics: device tensors, read by the caller when it logs


class LogRatioTransform:
    """Base of the transforms: ``__call__(policy_logps, ref_logps, mask) -> (log_ratios, metrics)``.

    ``log_ratios`` is ``[B, T]`` and zero on masked positions; ``METRIC_KEYS`` names every metric it reports (a loop
    that reduces metrics over ranks can declare its keys up front).
    """

    name = "base"
    METRIC_KEYS: Tuple[str, ...] = ()

    def __call__(self, policy_logps: torch.Tensor, ref_logps: torch.Tensor,
                 mask: torch.Tensor) -> Tuple[torch.Tensor, Metrics]:
        raise NotImplementedError


class NoTransform(LogRatioTransform):
    """The plain log-ratio ``(lp_pol - lp_ref) * mask`` (standard DPO, KTO and GRPO).

    It still reports ``unclamped_frac`` for the bounds given (what clipping *would* leave untouched), so plain and
    humanline runs log the same diagnostic.

    Args:
        log_eps_P: lower bound of the diagnostic.
        log_eps_R: upper bound of the diagnostic.
    """

    name = "none"
    METRIC_KEYS = ("unclamped_frac",)

    def __init__(self, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R):
        self.log_eps_P, self.log_eps_R = float(log_eps_P), float(log_eps_R)

    def __call__(self, policy_logps, ref_logps, mask):
        raw = policy_logps - ref_logps
        frac = unclamped_fraction(raw.detach(), mask, self.log_eps_P, self.log_eps_R)
        return raw * mask.to(policy_logps.dtype), {"unclamped_frac": frac}


class ClipTransform(LogRatioTransform):
    """Humanline clipping: ``clamp(lp_pol - lp_ref, log_eps_P, log_eps_R) * mask``.

    Args:
        log_eps_P: lower bound, ``<= 0`` (the paper's default -1.5).
        log_eps_R: upper bound, ``>= 0`` (the paper's default 1.5).

    Returns (when called):
        ``(log_ratios, {"unclamped_frac": fraction of counted tokens strictly inside the bounds})``.

    Shape:
        ``policy_logps``, ``ref_logps``, ``mask``: ``[B, T]``; ``log_ratios``: ``[B, T]``.
    """

    name = "clip"
    METRIC_KEYS = ("unclamped_frac",)

    def __init__(self, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R):
        check_bounds(log_eps_P, log_eps_R)
        self.log_eps_P, self.log_eps_R = float(log_eps_P), float(log_eps_R)

    def __call__(self, policy_logps, ref_logps, mask):
        raw = policy_logps - ref_logps
        clipped = clip_log_ratio(raw, self.log_eps_P, self.log_eps_R) * mask.to(policy_logps.dtype)
        return clipped, {"unclamped_frac": unclamped_fraction(raw.detach(), mask, self.log_eps_P, self.log_eps_R)}


class SampleTransform(LogRatioTransform):
    """Humanline sampling: ``d = lp_pol - lp_ref``; a rejected token keeps ``d``'s value but no gradient.

    ``d_hl = where(rejected, d.detach(), d) * mask`` with ``rejected`` from ``rejection_mask``. The transform
    keeps one ``torch.Generator`` per device, seeded with ``seed``, so runs repeat (give each data-parallel rank its
    own seed for independent draws; tensor/pipeline-parallel peers must share one).

    Args:
        gamma_P: the Beta draws' parameters (``> 0``).
        gamma_R: the Beta draws' parameters (``> 0``).
        beta_P: the Beta draws' parameters (``> 0``).
        beta_R: the Beta draws' parameters (``> 0``).
        seed: the generators' seed.

    Returns (when called):
        ``(log_ratios, {"rejected_frac": ..., "unclamped_frac": 1 - rejected_frac})``.

    Shape:
        as ``ClipTransform``.
    """

    name = "sample"
    METRIC_KEYS = ("rejected_frac", "unclamped_frac")

    def __init__(self, gamma_P: float = DEFAULT_GAMMA_P, gamma_R: float = DEFAULT_GAMMA_R,
                 beta_P: float = DEFAULT_BETA_P, beta_R: float = DEFAULT_BETA_R, seed: int = 0):
        for label, value in (("gamma_P", gamma_P), ("gamma_R", gamma_R), ("beta_P", beta_P), ("beta_R", beta_R)):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        self.gamma_P, self.gamma_R = float(gamma_P), float(gamma_R)
        self.beta_P, self.beta_R = float(beta_P), float(beta_R)
        self.seed = int(seed)
        self._generators: Dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """This transform's generator on ``device`` (created and seeded on first use)."""
        key = str(torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The generators' states, so a resumed run draws what the uninterrupted run would have."""
        return {key: gen.get_state() for key, gen in self._generators.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for key, value in state.items():
            self.generator(torch.device(key)).set_state(value)

    def __call__(self, policy_logps, ref_logps, mask):
        log_ratio = policy_logps - ref_logps
        rejected = rejection_mask(policy_logps, ref_logps, mask, self.gamma_P, self.gamma_R, self.beta_P, self.beta_R,
                                  generator=self.generator(policy_logps.device))
        sampled = torch.where(rejected, log_ratio.detach(), log_ratio) * mask.to(policy_logps.dtype)
        rejected_frac = fraction(rejected.sum(), mask.bool().sum(), 0.0)
        return sampled, {"rejected_frac": rejected_frac, "unclamped_frac": 1.0 - rejected_frac}

