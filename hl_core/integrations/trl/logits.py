"""TRL's own DPO and KTO losses on humanline log-ratios, for releases without the fused LM head (trl 1.14).

There ``DPOTrainer._compute_loss`` and ``KTOTrainer._compute_loss`` call the model for its logits and take each
sequence's per-token log-probs with ``selective_log_softmax_and_entropy`` (the policy's completions) or
``selective_log_softmax`` (KTO's mismatched rows, and every reference forward), names of the trainer's module. For the
duration of one ``_compute_loss`` call, `LogitsPair` stands in for the policy and the reference, and for those two
functions in the trainer's module:

* the policy stand-in runs the reference first on the same inputs (no grad, without router logits), queues its
  output, then runs the policy and marks the reference output as pending;
* the next log-prob call after a policy forward is the policy's: it returns ``lp_ref + d_hl`` (``d_hl`` the
  transformed log-ratio), with ``lp_ref`` from the pending reference logits, computed as TRL computes the reference's;
  any other call (the reference's) is TRL's own;
* the reference stand-in returns the queued outputs in order.

So, as with the fused head (``fused.FusedPair``), every difference TRL forms is a sum of transformed log-ratios, with
the transform's gradient. One difference: with ``use_weighting``, trl 1.14 computes the WPO weights from the per-token
log-probs it was given, here ``lp_ref + d_hl``, where the fused path keeps the policy's own.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from hl_core.swaps import swap_in_context, unswapped

from .stand_ins import ReferenceFirst, _order_refusal

PATCHED = ("selective_log_softmax", "selective_log_softmax_and_entropy")  # names in the trainer's module


class LogitsPair(ReferenceFirst):
    """The policy and the reference of one ``_compute_loss`` call, and the log-prob functions TRL calls on their logits.

    Args:
        trainer: the humanline trainer (its ``_humanline_log_ratios``).
        policy: the policy as TRL would call it (the wrapped model).
        reference: the reference (``ref_model``, or a PEFT policy running its ``ref`` adapter).
        originals: TRL's ``selective_log_softmax`` and ``selective_log_softmax_and_entropy``.
    """

    def __init__(self, trainer, policy, reference, originals: dict):
        super().__init__(trainer, policy, reference)
        self.originals = originals
        self.pending = None  # (the policy's output, the reference's) of the last policy forward, until its log-probs

    def policy_forward(self, *args, **kwargs):
        ref_out = self.run_reference(*args, **kwargs)
        out = self.policy(*args, **kwargs)
        self.pending = (out, ref_out)
        return out

    def selective_log_softmax(self, logits, index, *args, **kwargs):
        logps = self.originals["selective_log_softmax"](logits, index, *args, **kwargs)
        return self._humanline(logps, logits, index, args, kwargs)

    def selective_log_softmax_and_entropy(self, logits, index, *args, **kwargs):
        logps, entropy = self.originals["selective_log_softmax_and_entropy"](logits, index, *args, **kwargs)
        rest = {key: value for key, value in kwargs.items() if key != "entropy_requires_grad"}
        return self._humanline(logps, logits, index, args[1:], rest), entropy

    def _humanline(self, policy_logps, logits, index, args, kwargs):
        """``lp_ref + d_hl`` for the log-probs of a policy forward; any other call's log-probs unchanged.

        ``args``/``kwargs``: what follows ``index`` in ``selective_log_softmax``'s signature (``temperature``,
        ``row_mask``).
        """
        pending, self.pending = self.pending, None
        if pending is None:
            return policy_logps
        out, ref_out = pending
        if self.probing() and (logits.shape[0] != out.logits.shape[0] or logits.shape[-1] != out.logits.shape[-1]):
            raise _order_refusal(self.trainer, "took log-probs of other logits than the policy's last forward's")
        ref_logits = ref_out.logits[..., : logits.shape[-2], :]  # TRL's slice of the same positions: [..., :-1, :]
        ref_logps = self.originals["selective_log_softmax"](ref_logits, index, *args, **kwargs).detach()
        row_mask = kwargs.get("row_mask", args[1] if len(args) > 1 else None)
        mask = torch.ones_like(index) if row_mask is None else row_mask.long()
        return self.humanline_logps(policy_logps, ref_logps, mask)


@contextlib.contextmanager
def patched_log_probs(trainer_class, pair: LogitsPair):
    """``pair``'s log-prob functions in the module of ``trainer_class`` (TRL's trainer), for the block and the
    calling thread only (``hl_core.swaps.swap_in_context``): another trainer, in another thread, keeps TRL's own or
    its own stand-ins."""
    module = sys.modules[trainer_class.__module__]
    with contextlib.ExitStack() as stack:
        for name in PATCHED:
            stack.enter_context(swap_in_context(module, name, getattr(pair, name)))
        yield


def trl_log_prob_functions(trainer_class) -> dict:
    """TRL's log-prob functions as the trainer's module holds them (the originals the stand-ins call; under
    another thread's swap, the function the swap dispatches to)."""
    module = sys.modules[trainer_class.__module__]
    return {name: unswapped(module, name) for name in PATCHED}
