"""Humanline, written once: every objective receives log-ratios already transformed here.

The method (see docs/humanline-method.md, "Humanline: Online Alignment as Perceptual Loss"):

* clipping: ``d_hl[t] = clamp(lp_pol[t] - lp_ref[t], log_eps_P, log_eps_R)``; a clamped token keeps
  the bound value and gets zero gradient (plain ``clamp`` semantics).
* sampling: two-sided token rejection; a rejected token keeps its log-ratio value in the forward pass
  but is detached (no gradient).
* syncing: every ``k`` optimizer updates, after backward and before ``optimizer.step()``, the reference
  weights are overwritten with the policy's (pre-update) weights: sync when ``n % k == 0`` where ``n``
  is the number of updates already done. With ``humanline.sync_mix = alpha < 1`` the sync is a soft update,
  ``ref = alpha * policy + (1 - alpha) * ref`` (``mix_into``).

The engines call two hooks: ``LogRatioTransform.__call__`` (per-token, in the loss path) and
``ReferenceSyncHook.before_optimizer_step`` (around the optimizer step).
"""

from __future__ import annotations

import math
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
    ``log_ratios`` is ``[B, T]`` and zero on masked positions; ``METRIC_KEYS`` names every metric it
    reports (the trainer reduces a fixed, declared set of keys).
    """

    name = "base"
    METRIC_KEYS: Tuple[str, ...] = ()

    def __call__(
        self, policy_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor
    ) -> Tuple[torch.Tensor, Dict[str, float]]:
        raise NotImplementedError


class NoTransform(LogRatioTransform):
    """Plain log-ratio ``lp_pol - lp_ref`` (standard DPO/KTO/GRPO).

    Still reports ``unclamped_frac`` for the bounds given (what clipping *would* leave untouched),
    so plain and humanline runs log the same diagnostic.
    """

    name = "none"
    METRIC_KEYS = ("unclamped_frac",)

    def __init__(self, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R):
        self.log_eps_P = float(log_eps_P)
        self.log_eps_R = float(log_eps_R)

    def __call__(self, policy_logps, ref_logps, mask):
        raw = policy_logps - ref_logps
        frac = unclamped_fraction(raw.detach(), mask, self.log_eps_P, self.log_eps_R)
        return raw * mask.to(policy_logps.dtype), {"unclamped_frac": frac}


class ClipTransform(LogRatioTransform):
    """Humanline clipping: ``clamp(lp_pol - lp_ref, log_eps_P, log_eps_R)`` on every non-masked token."""

    name = "clip"
    METRIC_KEYS = ("unclamped_frac",)

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


register_transform("none", lambda cfg, seed: NoTransform(cfg.log_eps_P, cfg.log_eps_R))
register_transform("clip", lambda cfg, seed: ClipTransform(cfg.log_eps_P, cfg.log_eps_R))


def transform_names():
    return sorted(_TRANSFORMS)


def build_transform(humanline_cfg, seed: int = 0) -> LogRatioTransform:
    """Build the transform named by ``humanline.transform`` (``clip``, ``sample`` or ``none``).

    ``seed`` seeds stochastic transforms (pass a rank-dependent one for independent draws per rank).
    """
    return _TRANSFORMS[humanline_cfg.transform](humanline_cfg, seed)


# ---------------------------------------------------------------------------------------------
# Syncing
# ---------------------------------------------------------------------------------------------


def should_sync(updates_done: int, sync_every: Optional[int], offset: int = 0) -> bool:
    """Sync before update ``n`` (``n`` = updates already done) when ``n % k == offset``; never when k is None."""
    return sync_every is not None and updates_done % sync_every == offset


def mix_into(reference: torch.Tensor, policy: torch.Tensor, mix: float) -> None:
    """In place: ``reference = mix * policy + (1 - mix) * reference``, elementwise, so any shard of a parameter
    mixes as the whole would. ``mix == 1`` is a plain copy (bit for bit); otherwise ``torch.lerp``, which rounds
    once in the tensor's dtype (``mul_`` then ``add_`` would round twice: in bf16, a drift of up to an ulp of the
    weight per sync, larger than a small ``mix``'s step)."""
    if mix == 1.0:
        reference.copy_(policy)
    else:
        reference.lerp_(policy, mix)


@dataclass
class SyncRecord:
    synced: bool
    seconds: float


class ReferenceSyncHook:
    """Called by the trainer after backward (and gradient clipping) and before the optimizer step.

    ``engine.sync_reference(mix)`` must mix (``mix_into``) each rank's own shard of every policy parameter into
    the matching reference shard (no gather); ``mix`` 1 is the copy.
    """

    def __init__(self, sync_every: Optional[int], offset: int = 0, mix: float = 1.0):
        if sync_every is not None and sync_every < 1:
            raise ValueError("sync_every must be >= 1 or None")
        if not 0.0 < mix <= 1.0:
            raise ValueError(f"the sync's mix must be in (0, 1], got {mix}")
        self.sync_every, self.offset, self.mix = sync_every, offset, float(mix)
        self.num_syncs = 0

    def before_optimizer_step(self, engine, updates_done: int) -> SyncRecord:
        if not should_sync(updates_done, self.sync_every, self.offset):
            return SyncRecord(False, 0.0)
        engine.synchronize()  # GPU: time the copy, not the tail of the backward still in flight
        start = time.perf_counter()
        engine.sync_reference(self.mix)
        engine.synchronize()
        self.num_syncs += 1
        return SyncRecord(True, time.perf_counter() - start)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

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


class SampleTransform(LogRatioTransform):
    """Humanline sampling: ``d = lp_pol - lp_ref``; rejected tokens keep ``d`` but are detached.

    ``d_hl = where(rejected, d.detach(), d) * mask`` with ``rejected`` from ``rejection_mask``.
    Keeps its own ``torch.Generator`` per device, seeded with ``seed``, so runs are reproducible
    (pass a rank-dependent seed for independent draws across data-parallel ranks).
    Metrics: ``rejected_frac`` and ``unclamped_frac`` (non-masked tokens NOT rejected, i.e. the
    tokens that carry gradient).
    """

    name = "sample"
    METRIC_KEYS = ("rejected_frac", "unclamped_frac")

    def __init__(
        self,
        gamma_P: float = DEFAULT_GAMMA_P,
        gamma_R: float = DEFAULT_GAMMA_R,
        beta_P: float = DEFAULT_BETA_P,
        beta_R: float = DEFAULT_BETA_R,
        seed: int = 0,
    ):
        for label, value in (("gamma_P", gamma_P), ("gamma_R", gamma_R), ("beta_P", beta_P), ("beta_R", beta_R)):
            if not value > 0:
                raise ValueError(f"{label} must be > 0, got {value}")
        self.gamma_P = float(gamma_P)
        self.gamma_R = float(gamma_R)
        self.beta_P = float(beta_P)
        self.beta_R = float(beta_R)
        self.seed = int(seed)
        self._generators: Dict[str, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        """This transform's generator on ``device`` (created and seeded on first use)."""
        key = str(torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """Generator states, so a resumed run draws what the uninterrupted run would have."""
        return {key: gen.get_state() for key, gen in self._generators.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        for key, value in state.items():
            self.generator(torch.device(key)).set_state(value)

    def __call__(self, policy_logps, ref_logps, mask):
        mask_f = mask.to(policy_logps.dtype)
        log_ratio = policy_logps - ref_logps
        rejected = rejection_mask(
            policy_logps,
            ref_logps,
            mask,
            self.gamma_P,
            self.gamma_R,
            self.beta_P,
            self.beta_R,
            generator=self.generator(policy_logps.device),
        )
        sampled = torch.where(rejected, log_ratio.detach(), log_ratio) * mask_f
        n = int(mask.bool().sum())
        rejected_frac = float(rejected.sum()) / n if n else 0.0
        return sampled, {"rejected_frac": rejected_frac, "unclamped_frac": 1.0 - rejected_frac}


register_transform(
    "sample",
    lambda cfg, seed: SampleTransform(cfg.gamma_P, cfg.gamma_R, cfg.beta_P, cfg.beta_R, seed=seed),
)
