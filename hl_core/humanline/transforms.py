"""Per-token log-ratio transforms: what every objective receives in place of ``lp_pol - lp_ref``.

A transform is called as ``transform(policy_logps, ref_logps, mask) -> (log_ratios, metrics)``. The call checks its
arguments first (``hl_core/humanline/contract.py``); ``log_ratios`` is exactly 0 wherever the mask is 0, whatever the
log-probs hold there (the value is selected, never multiplied by the mask, so a NaN in padding stays out). Its metrics
are 0-dim float64 tensors on the log-probs' device: reading them (``float(v)``) is the caller's choice.

A non-finite log-prob at a counted position is never counted as clipped or kept: with ``check_finite=True`` (the
default) the call raises ``NonFiniteLogRatioError`` (one host read per call, which also checks the mask holds only 0
and 1); with ``check_finite=False`` nothing is read on the host, the log-ratio there and the metrics are NaN, and the
caller's guard stops the update (our trainer's reads the metrics in its one reduction per update).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ..errors import HumanlineStateError, NonFiniteLogRatioError
from .contract import clip_bounds, describe, log_probs_and_mask, refuse, whole_number
from .functional import (
    DEFAULT_LOG_EPS_P,
    DEFAULT_LOG_EPS_R,
    beta_parameters,
    clamp,
    counted_nonfinite,
    fraction,
    inside_fraction,
    nan_if,
)
from .sampling import DEFAULT_BETA_P, DEFAULT_BETA_R, DEFAULT_GAMMA_P, DEFAULT_GAMMA_R, draw_rejections

Metrics = Dict[str, torch.Tensor]  # a transform's diagnostics: device tensors, read by the caller when it logs
MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes


def _flag(where: str, argument: str, value) -> bool:
    if not isinstance(value, bool):
        raise refuse(where, argument, "True or False", value,
                              "pass check_finite=True (raise on a non-finite counted log-prob) or False (NaN metrics "
                              "for your guard)")
    return value


class LogRatioTransform:
    """Base of the transforms: ``__call__(policy_logps, ref_logps, mask) -> (log_ratios, metrics)``.

    ``__call__`` checks the arguments (two floating-point ``[B, T]`` log-prob tensors and a ``[B, T]`` mask of one
    shape and device; see the module docstring for the finiteness rule), calls ``apply`` and zeroes every masked
    position by selection. A subclass implements ``apply(policy_logps, ref_logps, counted)`` (``counted``: a bool
    mask) and names its metrics in ``METRIC_KEYS`` (a loop that reduces metrics over ranks can declare its keys up
    front). ``state_dict()`` / ``load_state_dict()`` carry what a resumed run needs (nothing, for a deterministic
    transform).

    Args:
        check_finite: raise ``NonFiniteLogRatioError`` on a non-finite log-prob at a counted position (one host read
            per call), or give NaN there and NaN metrics (``False``: no host read; your guard stops the update).
    """

    name = "base"
    METRIC_KEYS: Tuple[str, ...] = ()

    def __init__(self, check_finite: bool = True):
        self.check_finite = _flag(f"{type(self).__name__}()", "check_finite", check_finite)

    def __call__(self, policy_logps: torch.Tensor, ref_logps: torch.Tensor,
                 mask: torch.Tensor) -> Tuple[torch.Tensor, Metrics]:
        where = f"{type(self).__name__}.__call__"
        log_probs_and_mask(where, policy_logps, ref_logps, mask)
        counted = mask != 0
        if self.check_finite:
            _refuse_bad_values(where, policy_logps, ref_logps, mask, counted)
        log_ratios, metrics = self.apply(policy_logps, ref_logps, counted)
        return torch.where(counted, log_ratios, torch.zeros((), dtype=log_ratios.dtype,
                                                            device=log_ratios.device)), metrics

    def apply(self, policy_logps: torch.Tensor, ref_logps: torch.Tensor,
              counted: torch.Tensor) -> Tuple[torch.Tensor, Metrics]:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:
        """What a resumed run needs: nothing for a deterministic transform."""
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``; a deterministic transform takes only ``{}``."""
        if not isinstance(state, dict) or state:
            raise HumanlineStateError(
                f"`{type(self).__name__}.load_state_dict`: `state` must be {{}} (this transform keeps no state), got "
                f"{describe(state)}. Fix: pass the state_dict() of the same kind of transform (a "
                "SampleTransform's state goes to a SampleTransform).")


def _refuse_bad_values(where: str, policy_logps, ref_logps, mask, counted) -> None:
    """One host read: a mask value other than 0/1, or a non-finite log-prob at a counted position, is refused."""
    flags = [counted_nonfinite(policy_logps, counted), counted_nonfinite(ref_logps, counted)]
    if mask.dtype != torch.bool:
        flags.append(((mask != 0) & (mask != 1)).any())
    bad = torch.stack(flags).tolist()
    if len(bad) > 2 and bad[2]:
        raise refuse(where, "mask", "0 or 1 at every position", mask,
                              "pass a 0/1 (or bool) token mask; weight tokens in your objective, not in the mask")
    for argument, values, flagged in (("policy_logps", policy_logps, bad[0]), ("ref_logps", ref_logps, bad[1])):
        if flagged:
            position = (counted & ~torch.isfinite(values)).nonzero()[0].tolist()
            value = float(values.detach()[tuple(position)])
            raise NonFiniteLogRatioError(
                f"`{where}`: `{argument}` is {value} at {position}, a position the mask counts: the update is "
                "refused, as the trainer's NaN guard stops a run (a non-finite log-ratio is neither clipped nor "
                "kept). Fix: find where the log-probs went non-finite (the loss scale, the learning rate, the "
                "data); masked positions may hold anything.")


class NoTransform(LogRatioTransform):
    """The plain log-ratio ``lp_pol - lp_ref`` on counted positions, 0 elsewhere (standard DPO, KTO and GRPO).

    It still reports ``unclamped_frac`` for the bounds given (what clipping *would* leave untouched), so plain and
    humanline runs log the same diagnostic; the bounds are refused where ``ClipTransform`` refuses them.

    Args:
        log_eps_P: lower bound of the diagnostic: finite, ``<= 0``.
        log_eps_R: upper bound of the diagnostic: finite, ``>= 0``.
        check_finite: see ``LogRatioTransform``.
    """

    name = "none"
    METRIC_KEYS = ("unclamped_frac",)

    def __init__(self, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R,
                 check_finite: bool = True):
        self.log_eps_P, self.log_eps_R = clip_bounds("NoTransform()", log_eps_P, log_eps_R)
        super().__init__(check_finite)

    def apply(self, policy_logps, ref_logps, counted):
        raw = policy_logps - ref_logps
        return raw, {"unclamped_frac": inside_fraction(raw.detach(), counted, self.log_eps_P, self.log_eps_R)}


class ClipTransform(LogRatioTransform):
    """Humanline clipping: ``clamp(lp_pol - lp_ref, log_eps_P, log_eps_R)`` on counted positions, 0 elsewhere.

    Args:
        log_eps_P: lower bound: finite, ``<= 0`` (the paper's default -1.5).
        log_eps_R: upper bound: finite, ``>= 0`` (the paper's default 1.5).
        check_finite: see ``LogRatioTransform``.

    Returns (when called):
        ``(log_ratios, {"unclamped_frac": fraction of counted tokens strictly inside the bounds})``.

    Shape:
        ``policy_logps``, ``ref_logps``, ``mask``: ``[B, T]``, one shape; ``log_ratios``: ``[B, T]``.
    """

    name = "clip"
    METRIC_KEYS = ("unclamped_frac",)

    def __init__(self, log_eps_P: float = DEFAULT_LOG_EPS_P, log_eps_R: float = DEFAULT_LOG_EPS_R,
                 check_finite: bool = True):
        self.log_eps_P, self.log_eps_R = clip_bounds("ClipTransform()", log_eps_P, log_eps_R)
        super().__init__(check_finite)

    def apply(self, policy_logps, ref_logps, counted):
        raw = policy_logps - ref_logps
        clipped = clamp(raw, self.log_eps_P, self.log_eps_R)
        return clipped, {"unclamped_frac": inside_fraction(raw.detach(), counted, self.log_eps_P, self.log_eps_R)}


class SampleTransform(LogRatioTransform):
    """Humanline sampling: ``d = lp_pol - lp_ref``; a rejected token keeps ``d``'s value but no gradient.

    ``d_hl = where(rejected, d.detach(), d)`` on counted positions, 0 elsewhere, with ``rejected`` from
    ``functional.rejection_mask``. The transform keeps one ``torch.Generator`` per device, seeded with ``seed``, so
    runs repeat (give each data-parallel rank its own seed for independent draws; tensor/pipeline-parallel peers must
    share one); ``state_dict()`` holds the generators' states, so a resumed run draws what the uninterrupted run
    would.

    Args:
        gamma_P: the Beta draws' parameters: finite, ``> 0``.
        gamma_R: the Beta draws' parameters: finite, ``> 0``.
        beta_P: the Beta draws' parameters: finite, ``> 0``.
        beta_R: the Beta draws' parameters: finite, ``> 0``.
        seed: the generators' seed, a whole number in ``[0, 2**64)``.
        check_finite: see ``LogRatioTransform``.

    Returns (when called):
        ``(log_ratios, {"rejected_frac": ..., "unclamped_frac": 1 - rejected_frac})``; an empty batch (``B = 0``)
        gives an empty ``log_ratios``, ``rejected_frac`` 0 and ``unclamped_frac`` 1.

    Shape:
        as ``ClipTransform``.
    """

    name = "sample"
    METRIC_KEYS = ("rejected_frac", "unclamped_frac")

    def __init__(self, gamma_P: float = DEFAULT_GAMMA_P, gamma_R: float = DEFAULT_GAMMA_R,
                 beta_P: float = DEFAULT_BETA_P, beta_R: float = DEFAULT_BETA_R, seed: int = 0,
                 check_finite: bool = True):
        params = beta_parameters("SampleTransform()", gamma_P, gamma_R, beta_P, beta_R)
        self.gamma_P, self.gamma_R, self.beta_P, self.beta_R = params
        self.seed = whole_number("SampleTransform()", "seed", seed, "pass a whole number in [0, 2**64)", 0, MAX_SEED)
        self._generators: Dict[str, torch.Generator] = {}
        super().__init__(check_finite)

    def generator(self, device: torch.device) -> torch.Generator:
        """This transform's generator on ``device`` (created and seeded on first use)."""
        key = str(torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def state_dict(self) -> Dict[str, torch.Tensor]:
        """The generators' states, ``{device: state}`` (uint8 CPU tensors), so a resumed run draws what the
        uninterrupted run would have."""
        return {key: gen.get_state() for key, gen in self._generators.items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict()``: every entry is checked first (a device this machine has, a generator state of
        that device's kind); a refusal (``HumanlineStateError``) changes nothing."""
        where = "SampleTransform.load_state_dict"
        fix = "pass what state_dict() returned, on a machine with the same devices"
        if not isinstance(state, dict):
            raise HumanlineStateError(f"`{where}`: `state` must be a dict {{device: generator state}}, got "
                                      f"{describe(state)}. Fix: {fix}.")
        checked = {}
        for key, value in state.items():
            try:
                device = torch.device(key)
                scratch = torch.Generator(device=device)
                scratch.set_state(value)
            except (RuntimeError, TypeError, ValueError) as exc:
                why = str(exc).strip().splitlines()[0][:100] if str(exc).strip() else type(exc).__name__
                raise HumanlineStateError(
                    f"`{where}`: the entry {key!r} is not a generator state of a device here "
                    f"({describe(value)}: {why}). Nothing was loaded. Fix: {fix}.") from None
            checked[str(device)] = value
        for key, value in checked.items():
            self.generator(torch.device(key)).set_state(value)

    def apply(self, policy_logps, ref_logps, counted):
        log_ratio = policy_logps - ref_logps
        rejected = draw_rejections(policy_logps, ref_logps, counted, self.gamma_P, self.gamma_R, self.beta_P,
                                   self.beta_R, generator=self.generator(policy_logps.device))
        sampled = torch.where(rejected, log_ratio.detach(), log_ratio)
        nonfinite = counted_nonfinite(log_ratio.detach(), counted)
        rejected_frac = nan_if(nonfinite, fraction(rejected.sum(), counted.sum(), 0.0))
        return sampled, {"rejected_frac": rejected_frac, "unclamped_frac": 1.0 - rejected_frac}
