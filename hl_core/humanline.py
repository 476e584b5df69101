"""Humanline, written once: every objective receives log-ratios already transformed here.

The method (see docs/humanline-method.md, "Humanline: Online Alignment as Perceptual Loss"):

* clipping: ``d_hl[t] = clamp(lp_pol[t] - lp_ref[t], log_eps_P, log_eps_R)``; a clamped token keeps
  the bound value and gets zero gradient (plain ``clamp`` semantics).
* sampling: two-sided token rejection; a rejected token keeps its log-ratio value in the forward pass
  but is detached (no gradient).
* syncing: every ``k`` optimizer updates, after backward and before ``optimizer.step()``, the reference
  weights are overwritten with the policy's (pre-update) weights: sync when ``n % k == 0`` where ``n``
  is the number of updates already done.

The engines call two hooks: ``LogRatioTransform.__call__`` (per-token, in the loss path) and
``ReferenceSyncHook.before_optimizer_step`` (around the optimizer step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

DEFAULT_LOG_EPS_P = -1.5
DEFAULT_LOG_EPS_R = 1.5


def clip_log_ratio(
    log_ratio: torch.Tensor, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R
) -> torch.Tensor:
    """Asymmetric log-space clip: ``clamp(log_ratio, log_eps_P, log_eps_R)``.

    Tokens outside ``[log_eps_P, log_eps_R]`` take the bound value and get zero gradient.
    """
    if not log_eps_P <= 0.0 <= log_eps_R:
        raise ValueError(f"need log_eps_P <= 0 <= log_eps_R, got ({log_eps_P}, {log_eps_R})")
    return torch.clamp(log_ratio, min=log_eps_P, max=log_eps_R)


def unclamped_fraction(
    log_ratio: torch.Tensor, mask: torch.Tensor, log_eps_P: float, log_eps_R: float
) -> float:
    """Fraction of non-masked tokens strictly inside ``(log_eps_P, log_eps_R)`` (1.0 when no tokens)."""
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return 1.0
    inside = (log_ratio > log_eps_P) & (log_ratio < log_eps_R) & mask
    return float(inside.sum()) / n


# ---------------------------------------------------------------------------------------------
# Log-ratio transforms: (policy_logps, ref_logps, mask) -> (transformed log-ratio, metrics)
# ---------------------------------------------------------------------------------------------


class LogRatioTransform:
    """Turns per-token log-probs into the log-ratios an objective consumes.

    ``__call__(policy_logps, ref_logps, mask)`` returns ``(log_ratios, metrics)`` where
    ``log_ratios`` is ``[B, T]`` and zero on masked positions.
    """

    name = "base"

    def __call__(
        self, policy_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        raise NotImplementedError


class NoTransform(LogRatioTransform):
    """Plain log-ratio ``lp_pol - lp_ref`` (standard DPO/KTO/GRPO)."""

    name = "none"

    def __call__(self, policy_logps, ref_logps, mask):
        mask = mask.to(policy_logps.dtype)
        log_ratio = (policy_logps - ref_logps) * mask
        return log_ratio, {}


class ClipTransform(LogRatioTransform):
    """Humanline clipping: ``clamp(lp_pol - lp_ref, log_eps_P, log_eps_R)`` on every non-masked token."""

    name = "clip"

    def __init__(self, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R):
        self.log_eps_P = float(log_eps_P)
        self.log_eps_R = float(log_eps_R)

    def __call__(self, policy_logps, ref_logps, mask):
        mask_f = mask.to(policy_logps.dtype)
        raw = policy_logps - ref_logps
        clipped = clip_log_ratio(raw, self.log_eps_P, self.log_eps_R) * mask_f
        frac = unclamped_fraction(raw.detach(), mask, self.log_eps_P, self.log_eps_R)
        return clipped, {"unclamped_frac": frac}


_TRANSFORMS: Dict[str, Callable[..., LogRatioTransform]] = {}


def register_transform(name: str, factory: Callable[..., LogRatioTransform]) -> None:
    _TRANSFORMS[name] = factory


register_transform("none", lambda cfg: NoTransform())
register_transform("clip", lambda cfg: ClipTransform(cfg.log_eps_P, cfg.log_eps_R))


def transform_names():
    return sorted(_TRANSFORMS)


def build_transform(humanline_cfg) -> LogRatioTransform:
    """Build the transform named by ``humanline.transform`` (``clip``, ``sample`` or ``none``)."""
    return _TRANSFORMS[humanline_cfg.transform](humanline_cfg)


# ---------------------------------------------------------------------------------------------
# Syncing
# ---------------------------------------------------------------------------------------------


def should_sync(updates_done: int, sync_every: Optional[int]) -> bool:
    """Sync before update ``n`` (``n`` = updates already done) when ``n % k == 0``; never when k is None."""
    return sync_every is not None and updates_done % sync_every == 0


@dataclass
class SyncRecord:
    synced: bool
    seconds: float


class ReferenceSyncHook:
    """Called by the trainer after backward (and gradient clipping) and before the optimizer step.

    ``engine.sync_reference()`` must copy each rank's own shard of every policy parameter into the
    matching reference shard (no gather).
    """

    def __init__(self, sync_every: Optional[int]):
        if sync_every is not None and sync_every < 1:
            raise ValueError("sync_every must be >= 1 or None")
        self.sync_every = sync_every
        self.num_syncs = 0

    def before_optimizer_step(self, engine, updates_done: int) -> SyncRecord:
        if not should_sync(updates_done, self.sync_every):
            return SyncRecord(False, 0.0)
        start = time.perf_counter()
        engine.sync_reference()
        self.num_syncs += 1
        return SyncRecord(True, time.perf_counter() - start)
