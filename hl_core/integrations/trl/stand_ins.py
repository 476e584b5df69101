"""What `fused.FusedPair` and `logits.LogitsPair` share: the reference run first on the policy's inputs and queued
for TRL's own reference call, and the transform of the policy's per-token log-probs into ``lp_ref + d_hl``."""

from __future__ import annotations

from collections import deque

import torch


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
        self.queued.append(ref_out)
        return ref_out

    def reference_forward(self, *args, **kwargs):
        """The reference's output for the policy's forward of the same inputs (queued by `run_reference`)."""
        return self.queued.popleft()

    def humanline_logps(self, policy_logps, ref_logps, mask):
        """``lp_ref + d_hl`` (``d_hl`` the transformed log-ratio), keeping the transform's metrics.

        Shape:
            ``policy_logps``, ``ref_logps``, ``mask``: ``[B, T - 1]``, TRL's shifted layout; the transform sees
            the layout of ``input_ids`` (a lead column), so a sampling transform draws for the same positions.
        """
        log_ratios, metrics, _ = self.trainer._humanline_log_ratios(policy_logps, ref_logps, mask)
        self.metrics.append(metrics)
        return ref_logps + log_ratios[:, 1:]
