"""The public API's contract, checked at the boundary: every argument's type, shape, dtype, range and finiteness,
before any tensor is touched. A refusal is a ``HumanlineUsageError`` whose one paragraph names the argument (as
``Owner(argument=...)``), what it accepts and the fix. ``docs/reference/humanline-api.md`` lists the contract.

These checks read metadata only (types, shapes, dtypes, devices), never a tensor's values: those are checked where
the contract says so (``value_problems``), in one host read.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch

from ..errors import HumanlineUsageError


def refuse(where: str, argument: str, accepts: str, got, fix: str, shown: Optional[str] = None) -> HumanlineUsageError:
    """The error for ``where(argument=got)``: what the argument accepts, what it got (``shown``, else a description
    of ``got``), the fix."""
    return HumanlineUsageError(f"`{where}`: `{argument}` must be {accepts}, got {shown or describe(got)}. Fix: {fix}")


def describe(value) -> str:
    """A short, safe description of ``value`` for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)} on {value.device}"
    if isinstance(value, type):
        return f"the class `{value.__name__}` (not an instance)"
    if isinstance(value, torch.nn.Module):
        return f"a {type(value).__name__} module"
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def real_number(where: str, argument: str, value, fix: str, low: Optional[float] = None, high: Optional[float] = None,
         low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float: a finite real number (an ``int`` or ``float``, not a ``bool`` or a string) within
    ``[low, high]`` (an end excluded when ``*_open``)."""
    accepts = f"a finite real number{_range(low, high, low_open, high_open)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or isinstance(value, torch.Tensor):
        raise refuse(where, argument, accepts, value, fix)
    number = float(value)
    if not math.isfinite(number):
        raise refuse(where, argument, accepts, value, fix)
    too_low = low is not None and (number <= low if low_open else number < low)
    too_high = high is not None and (number >= high if high_open else number > high)
    if too_low or too_high:
        raise refuse(where, argument, accepts, value, fix)
    return number


def _range(low, high, low_open: bool = False, high_open: bool = False) -> str:
    """`` in [low, high]``, `` > low``, `` <= high``... as the bounds given say ('' for none)."""
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def whole_number(where: str, argument: str, value, fix: str, low: Optional[int] = None,
                 high: Optional[int] = None) -> int:
    """``value`` as an int: a whole number (an ``int``, not a ``bool``, a ``float`` or a string) in
    ``[low, high]``."""
    accepts = f"a whole number (int){_range(low, high)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise refuse(where, argument, accepts, value, fix)
    number = int(value)
    if (low is not None and number < low) or (high is not None and number > high):
        raise refuse(where, argument, accepts, value, fix)
    return number


def tensor_arg(where: str, argument: str, value, dims: Optional[int], kinds: Sequence[str], fix: str) -> torch.Tensor:
    """``value``: a ``torch.Tensor`` of ``dims`` dimensions (any when None) whose dtype is of one of ``kinds``
    (``"float"``, ``"int"``, ``"bool"``)."""
    names = {"float": "floating-point", "int": "integer", "bool": "bool"}
    shape = f"a {dims}-D " if dims is not None else "a "
    accepts = f"{shape}torch.Tensor of {' or '.join(names[k] for k in kinds)} dtype"
    if not isinstance(value, torch.Tensor):
        raise refuse(where, argument, accepts, value, fix)
    kind = ("bool" if value.dtype == torch.bool else "float" if value.dtype.is_floating_point
            else "complex" if value.dtype.is_complex else "int")
    if kind not in kinds or (dims is not None and value.dim() != dims):
        raise refuse(where, argument, accepts, value, fix)
    return value


def same_shape(where: str, argument: str, value: torch.Tensor, reference_name: str, reference: torch.Tensor,
         fix: str) -> None:
    """``value`` has ``reference``'s shape, exactly (no broadcasting), and its device."""
    if tuple(value.shape) != tuple(reference.shape) or value.device != reference.device:
        raise refuse(where, argument, f"of `{reference_name}`'s shape {list(reference.shape)} (no broadcasting) "
                     f"and on its device ({reference.device})", value, fix)


def instance_of(where: str, argument: str, value, cls, accepts: str, fix: str):
    """``value`` is an instance of ``cls`` (a class passed where an instance is wanted is refused too)."""
    if not isinstance(value, cls):
        raise refuse(where, argument, accepts, value, fix)
    return value


def dtype_arg(where: str, argument: str, value, kinds: Sequence[str], fix: str) -> torch.dtype:
    """``value`` is a ``torch.dtype`` of one of ``kinds``."""
    names = {"float": "floating-point", "int": "integer", "bool": "bool"}
    accepts = f"a torch.dtype ({' or '.join(names[k] for k in kinds)})"
    if not isinstance(value, torch.dtype):
        raise refuse(where, argument, accepts, value, fix)
    kind = "bool" if value == torch.bool else "float" if value.is_floating_point else "int"
    if value.is_complex or kind not in kinds:
        raise refuse(where, argument, accepts, value, fix)
    return value


def log_probs_and_mask(where: str, policy_logps, ref_logps, mask) -> None:
    """A transform's inputs: two floating-point ``[B, T]`` log-prob tensors and a ``[B, T]`` mask (bool, integer or
    floating-point), all of one shape (no broadcasting) on one device."""
    fix = ("pass per-token log-probs [B, T] of both models (`prefix_token_logps`) and the token mask [B, T] over "
           "the same positions (`mask_from_labels`)")
    tensor_arg(where, "policy_logps", policy_logps, 2, ("float",), fix)
    tensor_arg(where, "ref_logps", ref_logps, 2, ("float",), fix)
    tensor_arg(where, "mask", mask, 2, ("bool", "int", "float"), fix)
    same_shape(where, "ref_logps", ref_logps, "policy_logps", policy_logps, fix)
    same_shape(where, "mask", mask, "policy_logps", policy_logps, fix)


def clip_bounds(where: str, log_eps_P, log_eps_R) -> tuple:
    """Clip bounds: finite reals with ``log_eps_P <= 0 <= log_eps_R``."""
    fix = "pass log_eps_P <= 0 <= log_eps_R, both finite (the paper's default is -1.5, 1.5)"
    low = real_number(where, "log_eps_P", log_eps_P, fix, high=0.0)
    high = real_number(where, "log_eps_R", log_eps_R, fix, low=0.0)
    return low, high
