"""What `fused.FusedPair` and `logits.LogitsPair` share: the reference run first on the policy's inputs and queued
for TRL's own reference call, and the transform of the policy's per-token log-probs into ``lp_ref + d_hl``.

The queue is TRL's order contract (``internals.RUNTIME_CONTRACTS``): TRL calls the policy, then the reference on the
same inputs. Every reference call checks the order (an empty queue: the reference called first), and during the
first update (the probe) also that the reference gets the policy's input ids; either is refused with
``UnsupportedTrlError`` instead of handing TRL another batch's reference log-probs.
"""

from __future__ import annotations

from collections import deque

import torch
import trl

from .compat import UnsupportedTrlError


class ReferenceFirst:
    """The policy and the reference of one ``_compute_loss`` call.

    Args:
        trainer: the humanline trainer (its ``_humanline_log_ratios``).
        policy: the policy as TRL would call it (the wrapped model).
        reference: the reference (``ref_model``, or a PEFT policy running its ``ref`` adapter).
    """

    def __init__(self, trainer, policy, reference):
        self.trainer, self.policy, self.reference = trainer, policy, reference
        self.queued = deque()
        self.metrics = []

    def run_reference(self, *args, **kwargs):
        """The reference on the policy's inputs (no grad, without router logits), queued for `reference_forward`."""
        ref_kwargs = {key: value for key, value in kwargs.items() if key != "output_router_logits"}
        with torch.no_grad():
            ref_out = self.reference(*args, **ref_kwargs)
        self.queued.append((_input_ids(args, kwargs), ref_out))
        return ref_out

    def reference_forward(self, *args, **kwargs):
        """The reference's output for the policy's forward of the same inputs (queued by `run_reference`).

        Raises:
            UnsupportedTrlError: TRL called the reference before the policy, or on other input ids.
        """
        if not self.queued:
            raise _order_refusal(self.trainer, "called the reference model before the policy")
        ids, ref_out = self.queued.popleft()
        asked = _input_ids(args, kwargs) if self.probing() else None  # the probe: the first update only (a host read)
        if ids is not None and asked is not None and (ids.shape != asked.shape or not torch.equal(ids, asked)):
            raise _order_refusal(self.trainer, "called the reference model on other inputs than the policy's last "
                                 "forward")
        return ref_out

    def probing(self) -> bool:
        """Whether the first-update probe runs (it reads tensors on the host)."""
        state = getattr(self.trainer, "state", None)
        return state is None or state.global_step == 0

    def humanline_logps(self, policy_logps, ref_logps, mask):
        """``lp_ref + d_hl`` (``d_hl`` the transformed log-ratio), keeping the transform's metrics.

        Shape:
            ``policy_logps``, ``ref_logps``, ``mask``: ``[B, T - 1]``, TRL's shifted layout; the transform sees
            the layout of ``input_ids`` (a lead column), so a sampling transform draws for the same positions.
        """
        log_ratios, metrics, _ = self.trainer._humanline_log_ratios(policy_logps, ref_logps, mask)
        self.metrics.append(metrics)
        return ref_logps + log_ratios[:, 1:]


def _input_ids(args, kwargs):
    """The ``input_ids`` of a forward call (the first positional argument, or the keyword), or None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids if isinstance(ids, torch.Tensor) else None


def _order_refusal(trainer, what: str) -> UnsupportedTrlError:
    name = getattr(trainer, "_trl_trainer", "the trainer")
    return UnsupportedTrlError(
        f"trl {trl.__version__}'s {name}._compute_loss {what}, where the humanline adapter relies on TRL calling the "
        "policy first and then the reference on the same inputs (it computes the reference with the policy's call "
        "and hands it back in order), so it would pair log-probs of different rows. Fix: install a supported "
        "release (`pip install -e .[trl]`), or use our own trainer (launchers/run.py) or your own loop "
        "(docs/howto/own-loop.md)."
    )
