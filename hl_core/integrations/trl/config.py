"""Humanline's settings as fields of TRL's own configs: ``HumanlineDPOConfig``, ``HumanlineKTOConfig``,
``HumanlineGRPOConfig``.

The fields the authors' TRL pull request names (``humanline``, ``humanline_log_eps_P``, ``humanline_log_eps_R``,
``humanline_sync_freq``), and ours: the transform (``humanline_transform``: ``clip``, ``sample`` or ``none``), the
sample transform's Beta draws and seed, and the sync's mix and offset. They parse from the command line and from YAML
through ``TrlParser`` like TRL's own fields, travel in the checkpoint's ``training_args.bin`` with them, and the
humanline trainers read them: ``humanline=False`` is TRL's own trainer.

``settings(config, transform, schedule)`` turns a config (ours or TRL's) and the trainers' keyword objects into what
the trainer runs, and refuses, in one paragraph, a keyword object the config disagrees with.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Optional

from trl import DPOConfig, GRPOConfig, KTOConfig

from hl_core.humanline import ClipTransform, LogRatioTransform, NoTransform, SampleTransform, SyncSchedule
from hl_core.humanline.functional import DEFAULT_LOG_EPS_P, DEFAULT_LOG_EPS_R
from hl_core.humanline.sampling import DEFAULT_BETA_P, DEFAULT_BETA_R, DEFAULT_GAMMA_P, DEFAULT_GAMMA_R

from .compat import HumanlineTrlSettingError

TRANSFORMS = ("clip", "sample", "none")
UNSET = object()  # a keyword the caller did not pass
SEED_STRIDE = 1000  # a rank's sampling seed: the base seed + 1000 * its process index (as the pack's trainer)


def _beta_draw(default: float, which: str, against: str):
    """A field of the sample transform's Beta draws."""
    return field(default=default, metadata={"help": f"{which} parameter of the Beta draw against the {against} "
                                                    "(`'sample'` only), `> 0`."})


@dataclass
class HumanlineArguments:
    r"""
    The humanline fields of `HumanlineDPOConfig`, `HumanlineKTOConfig` and `HumanlineGRPOConfig`.

    Parameters:
        humanline (`bool`, *optional*, defaults to `False`):
            Whether to train with humanline: the per-token log-ratios against the reference transformed (clipped)
            before the loss, and the reference synced with the policy's pre-update weights every
            `humanline_sync_freq` updates. If `False`, the trainer is TRL's own.
        humanline_log_eps_P (`float`, *optional*, defaults to `-1.5`):
            Lower bound of the clip on each token's log-ratio, `<= 0`.
        humanline_log_eps_R (`float`, *optional*, defaults to `1.5`):
            Upper bound of the clip on each token's log-ratio, `>= 0`.
        humanline_sync_freq (`int`, *optional*, defaults to `1`):
            Number of optimizer updates between two syncs of the reference (the paper's `k`).
        humanline_transform (`str`, *optional*, defaults to `"clip"`):
            Transform of the per-token log-ratios: `"clip"` (clamp to the bounds), `"sample"` (humanline sampling:
            rejected tokens keep their value without gradient) or `"none"` (syncing only).
        humanline_gamma_P (`float`, *optional*, defaults to `0.5`):
            First parameter of the Beta draw against the policy (`"sample"` only), `> 0`.
        humanline_gamma_R (`float`, *optional*, defaults to `0.01`):
            First parameter of the Beta draw against the reference (`"sample"` only), `> 0`.
        humanline_beta_P (`float`, *optional*, defaults to `1.0`):
            Second parameter of the Beta draw against the policy (`"sample"` only), `> 0`.
        humanline_beta_R (`float`, *optional*, defaults to `1.0`):
            Second parameter of the Beta draw against the reference (`"sample"` only), `> 0`.
        humanline_sample_seed (`int`, *optional*):
            Seed of the sample transform's draws; rank `r` draws with `seed + 1000 * r`. If `None`, `seed` is used.
        humanline_sync_mix (`float`, *optional*, defaults to `1.0`):
            How far each sync moves the reference: `1.0` copies the policy, `alpha < 1` sets
            `ref = alpha * policy + (1 - alpha) * ref`.
        humanline_sync_offset (`int`, *optional*, defaults to `0`):
            Sync before update `n` when `n` modulo `humanline_sync_freq` equals `humanline_sync_offset`.
    """

    humanline: bool = field(
        default=False,
        metadata={"help": "Whether to train with humanline: the per-token log-ratios against the reference "
                  "transformed (clipped) before the loss, and the reference synced with the policy's pre-update "
                  "weights every `humanline_sync_freq` updates. If `False`, the trainer is TRL's own."},
    )
    humanline_log_eps_P: float = field(
        default=DEFAULT_LOG_EPS_P, metadata={"help": "Lower bound of the clip on each token's log-ratio, `<= 0`."})
    humanline_log_eps_R: float = field(
        default=DEFAULT_LOG_EPS_R, metadata={"help": "Upper bound of the clip on each token's log-ratio, `>= 0`."})
    humanline_sync_freq: int = field(
        default=1, metadata={"help": "Number of optimizer updates between two syncs of the reference (the paper's "
                             "`k`)."})
    humanline_transform: str = field(
        default="clip",
        metadata={"help": "Transform of the per-token log-ratios: `'clip'` (clamp to the bounds), `'sample'` "
                  "(humanline sampling: rejected tokens keep their value without gradient) or `'none'` (syncing "
                  "only).", "choices": list(TRANSFORMS)},
    )
    humanline_gamma_P: float = _beta_draw(DEFAULT_GAMMA_P, "First", "policy")
    humanline_gamma_R: float = _beta_draw(DEFAULT_GAMMA_R, "First", "reference")
    humanline_beta_P: float = _beta_draw(DEFAULT_BETA_P, "Second", "policy")
    humanline_beta_R: float = _beta_draw(DEFAULT_BETA_R, "Second", "reference")
    humanline_sample_seed: Optional[int] = field(
        default=None, metadata={"help": "Seed of the sample transform's draws; rank `r` draws with "
                                "`seed + 1000 * r`. If `None`, `seed` is used."})
    humanline_sync_mix: float = field(
        default=1.0, metadata={"help": "How far each sync moves the reference: `1.0` copies the policy, `alpha < 1` "
                               "sets `ref = alpha * policy + (1 - alpha) * ref`."})
    humanline_sync_offset: int = field(
        default=0, metadata={"help": "Sync before update `n` when `n` modulo `humanline_sync_freq` equals "
                             "`humanline_sync_offset`."})

    def __post_init__(self):
        super().__post_init__()
        check_fields(self)


@dataclass
class HumanlineDPOConfig(HumanlineArguments, DPOConfig):
    """TRL's `DPOConfig` with humanline's fields (`HumanlineArguments`)."""


@dataclass
class HumanlineKTOConfig(HumanlineArguments, KTOConfig):
    """TRL's `KTOConfig` with humanline's fields (`HumanlineArguments`)."""


@dataclass
class HumanlineGRPOConfig(HumanlineArguments, GRPOConfig):
    """TRL's `GRPOConfig` with humanline's fields (`HumanlineArguments`)."""


CONFIGS = {"DPOTrainer": HumanlineDPOConfig, "KTOTrainer": HumanlineKTOConfig, "GRPOTrainer": HumanlineGRPOConfig}


def _refuse(name: str, value, need: str, fix: str) -> HumanlineTrlSettingError:
    return HumanlineTrlSettingError(f"`{name}={value!r}` is not accepted: {need}. Fix: {fix}.")


def _number(name: str, value, need: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise _refuse(name, value, need, f"set `{name}` to a finite number with {need.split(' must be ')[-1]}")


def check_fields(config: HumanlineArguments) -> None:
    """Refuse a humanline field out of its range, or ``sync_ref_model=True`` with ``humanline=True``.

    Raises:
        HumanlineTrlSettingError: one paragraph naming the field, what it takes and the fix.
    """
    if not isinstance(config.humanline, bool):
        raise _refuse("humanline", config.humanline, "it is a switch", "set `humanline` to true or false")
    if config.humanline_transform not in TRANSFORMS:
        raise _refuse("humanline_transform", config.humanline_transform, f"it names one of {', '.join(TRANSFORMS)}",
                      "set `humanline_transform` to `clip` (the paper's default), `sample` or `none`")
    _number("humanline_log_eps_P", config.humanline_log_eps_P, "the clip's lower bound must be <= 0",
            lambda v: v <= 0)
    _number("humanline_log_eps_R", config.humanline_log_eps_R, "the clip's upper bound must be >= 0",
            lambda v: v >= 0)
    for name in ("humanline_gamma_P", "humanline_gamma_R", "humanline_beta_P", "humanline_beta_R"):
        _number(name, getattr(config, name), "a Beta draw's parameter must be > 0", lambda v: v > 0)
    _number("humanline_sync_mix", config.humanline_sync_mix, "the sync's mix must be in (0, 1]",
            lambda v: 0 < v <= 1)
    freq, offset, seed = config.humanline_sync_freq, config.humanline_sync_offset, config.humanline_sample_seed
    if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
        raise _refuse("humanline_sync_freq", freq, "the number of updates between syncs is a whole number >= 1",
                      "set `humanline_sync_freq` to k (1: every update, as the paper's instruction-following runs)")
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < freq:
        raise _refuse("humanline_sync_offset", offset, f"the offset is a whole number in [0, {freq})",
                      f"set `humanline_sync_offset` to a whole number below `humanline_sync_freq` ({freq})")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _refuse("humanline_sample_seed", seed, "the seed is a whole number or None",
                      "set `humanline_sample_seed` to a whole number, or leave it unset to use `seed`")
    if config.humanline and getattr(config, "sync_ref_model", False):
        raise HumanlineTrlSettingError(
            "`sync_ref_model=True` cannot be combined with `humanline=True`: TRL's SyncRefModelCallback copies the "
            "reference at `on_step_end`, after the optimizer step (the post-update weights, gathered whole under "
            "ZeRO-3), where humanline syncs the pre-update weights shard by shard every `humanline_sync_freq` "
            "updates. Fix: set `sync_ref_model=False` and give the sync period as `humanline_sync_freq`.")


@dataclass(frozen=True)
class Settings:
    """What a humanline trainer runs: whether humanline is on, the transform and the sync's schedule."""

    enabled: bool
    transform: Optional[LogRatioTransform]
    schedule: Optional[SyncSchedule]


def config_transform(config: HumanlineArguments) -> LogRatioTransform:
    """The transform ``config``'s fields name (a sample transform seeded for this process)."""
    kind = config.humanline_transform
    if kind == "sample":
        base = config.seed if config.humanline_sample_seed is None else config.humanline_sample_seed
        return SampleTransform(config.humanline_gamma_P, config.humanline_gamma_R, config.humanline_beta_P,
                               config.humanline_beta_R, seed=base + SEED_STRIDE * config.process_index)
    cls = ClipTransform if kind == "clip" else NoTransform
    return cls(config.humanline_log_eps_P, config.humanline_log_eps_R)


def config_schedule(config: HumanlineArguments) -> SyncSchedule:
    return SyncSchedule(every=config.humanline_sync_freq, offset=config.humanline_sync_offset,
                        mix=config.humanline_sync_mix)


def describe(transform: Optional[LogRatioTransform], seed: bool = True) -> str:
    """``ClipTransform(log_eps_P=-1.5, log_eps_R=1.5)``: the transform's class and settings, to compare and show
    (``seed=False``: without a sampling seed, which differs between ranks)."""
    if transform is None:
        return "None"
    names = {ClipTransform: ("log_eps_P", "log_eps_R"), NoTransform: ("log_eps_P", "log_eps_R"),
             SampleTransform: ("gamma_P", "gamma_R", "beta_P", "beta_R", "seed")}.get(type(transform))
    shown = names if names is not None else sorted(k for k in vars(transform) if not k.startswith("_"))
    shown = [k for k in shown if seed or k != "seed"]
    return f"{type(transform).__name__}({', '.join(f'{k}={getattr(transform, k)!r}' for k in shown)})"


def _check_keyword_types(transform, schedule) -> None:
    if transform is not UNSET and transform is not None and not isinstance(transform, LogRatioTransform):
        if inspect.isclass(transform) and issubclass(transform, LogRatioTransform):
            need, fix = "a transform object, and this is its class", f"pass `transform={transform.__name__}()`"
        elif isinstance(transform, str):
            need = "a transform object (hl_core.humanline.ClipTransform(), SampleTransform(), NoTransform())"
            fix = (f"pass `transform=ClipTransform()` (or the object `{transform}` names), or set "
                   f"`humanline_transform=\"{transform}\"` in a HumanlineDPOConfig/KTOConfig/GRPOConfig")
        else:
            need = "a transform object (hl_core.humanline.ClipTransform(), SampleTransform(), NoTransform())"
            fix = "pass `transform=ClipTransform(log_eps_P, log_eps_R)`, or leave it out for the paper's clip"
        raise _refuse("transform", transform, f"`transform` takes {need}", fix)
    if schedule is not UNSET and schedule is not None and not isinstance(schedule, SyncSchedule):
        every = schedule if isinstance(schedule, int) and not isinstance(schedule, bool) else "k"
        raise _refuse("schedule", schedule, "`schedule` takes a hl_core.humanline.SyncSchedule, or None for a "
                      "frozen reference", f"pass `schedule=SyncSchedule(every={every})`")


def settings(config, transform=UNSET, schedule=UNSET) -> Settings:
    """What the trainer runs, from ``config`` (TRL's or a ``Humanline*Config``) and the keyword objects.

    With TRL's own config, the keywords decide (defaults: the paper's clip, a sync every update). With a
    ``Humanline*Config``, its fields decide, and a keyword object that says otherwise is refused.

    Raises:
        HumanlineTrlSettingError: a keyword of the wrong kind, or one the config disagrees with.
    """
    _check_keyword_types(transform, schedule)
    if not isinstance(config, HumanlineArguments):
        return Settings(True, ClipTransform() if transform in (UNSET, None) else transform,
                        SyncSchedule(every=1) if schedule is UNSET else schedule)
    check_fields(config)
    given = [name for name, value in (("transform", transform), ("schedule", schedule)) if value is not UNSET]
    if not config.humanline:
        if given:
            raise HumanlineTrlSettingError(
                f"`{'=` and `'.join(given)}=` given with a config whose `humanline` is False, which makes this "
                f"trainer TRL's own (no transform, no sync), so the keyword would be ignored. Fix: set "
                f"`humanline=True` in the config (with the matching `humanline_*` fields) and drop the keyword, or "
                f"drop `{given[0]}=`.")
        return Settings(False, None, None)
    mine = Settings(True, config_transform(config), config_schedule(config))
    for name, value, ours, show in (("transform", transform, mine.transform, describe),
                                    ("schedule", schedule, mine.schedule, repr)):
        if value is not UNSET and show(value) != show(ours):
            raise HumanlineTrlSettingError(
                f"`{name}={show(value)}` disagrees with the config, whose humanline fields give {show(ours)}, and "
                f"the trainer cannot honour both. Fix: drop `{name}=` and set the config's `humanline_*` fields, or "
                f"pass `{name}=` with a plain TRL config.")
    return mine


def fields_of(config) -> dict:
    """The humanline fields of ``config`` as a dict (empty for TRL's own config): what a checkpoint records."""
    if not isinstance(config, HumanlineArguments):
        return {}
    return {name: getattr(config, name) for name in HumanlineArguments.__dataclass_fields__}
