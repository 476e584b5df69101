"""The recipe's ``humanline`` section -> the public objects (internal glue: the public API takes plain arguments)."""

from __future__ import annotations

from typing import Callable, Dict

from .schedule import SyncSchedule
from .transforms import ClipTransform, LogRatioTransform, NoTransform, SampleTransform

# check_finite=False: the trainer's NaN guard reads the metrics (NaN where a counted log-prob is not finite) in its
# one reduction per update, so no call reads a value on the host
_TRANSFORMS: Dict[str, Callable[..., LogRatioTransform]] = {
    "none": lambda cfg, seed: NoTransform(cfg.log_eps_P, cfg.log_eps_R, check_finite=False),
    "clip": lambda cfg, seed: ClipTransform(cfg.log_eps_P, cfg.log_eps_R, check_finite=False),
    "sample": lambda cfg, seed: SampleTransform(cfg.gamma_P, cfg.gamma_R, cfg.beta_P, cfg.beta_R, seed=seed,
                                                check_finite=False),
}


def transform_names():
    return sorted(_TRANSFORMS)


def build_transform(humanline_cfg, seed: int = 0) -> LogRatioTransform:
    """The transform ``humanline.transform`` names; ``seed`` seeds a stochastic one (pass a data-parallel-rank
    dependent seed for independent draws per rank)."""
    return _TRANSFORMS[humanline_cfg.transform](humanline_cfg, seed)


def sync_schedule(humanline_cfg) -> SyncSchedule:
    """``humanline.sync_every``, ``sync_offset`` and ``sync_mix`` as a ``SyncSchedule``."""
    return SyncSchedule(humanline_cfg.sync_every, humanline_cfg.sync_offset, humanline_cfg.sync_mix)
