"""TRL's own DPO and KTO losses on humanline log-ratios: stand-ins for the policy and the reference inside one call of
TRL's ``_compute_loss``.

TRL 1.15/1.16 get each sequence's per-token log-probs from the fused LM head
(``model(..., labels=labels, fused_lm_head=True).log_probs``), policy first, then the reference, and form every loss
from ``sum_t lp_pol - sum_t lp_ref``. `FusedPair` hands TRL, in place of the policy's per-token log-probs,
``lp_ref + d_hl`` (``d_hl`` the transformed log-ratio ``T(lp_pol - lp_ref)``), and the reference's own log-probs for
the reference. Every difference TRL forms is then a sum of transformed log-ratios, with the transform's gradient
(a clamped token contributes none), so every DPO ``loss_type``, ``f_divergence_type``, ``ld_alpha``, KTO's ``kl``
(the mismatched rows) and its loss types, and the MoE router's auxiliary loss are TRL's own, on clipped log-ratios.
"""

from __future__ import annotations

import contextlib

import torch
import trl

from hl_core.swaps import swap

from .compat import fused_head_available
from .logits import LogitsPair, patched_log_probs, trl_log_prob_functions
from .stand_ins import ReferenceFirst


class FusedPair(ReferenceFirst):
    """The policy and the reference of one ``_compute_loss`` call, for TRL's fused-head forwards.

    The policy stand-in runs the reference first on the same inputs (no grad, without router logits), then the
    policy, transforms, and queues the reference's output; the reference stand-in returns the queued outputs in
    order (TRL asks for them in the order it asked the policy: DPO one forward, KTO the mismatched rows then the
    completions). A call without ``fused_lm_head`` (TRL's extra forward for ``compute_metrics``' logits) is the
    policy's own.

    Args:
        trainer: the humanline trainer (its ``_humanline_log_ratios``).
        policy: the policy as TRL would call it (the wrapped model).
        reference: the reference model (with a PEFT policy, the policy running its ``ref`` adapter).
    """

    def policy_forward(self, *args, fused_lm_head: bool = False, labels=None, **kwargs):
        """The policy's forward; with ``fused_lm_head``, its log-probs replaced by ``lp_ref + d_hl``."""
        if not fused_lm_head:
            return self.policy(*args, **kwargs) if labels is None else self.policy(*args, labels=labels, **kwargs)
        ref_out = self.run_reference(*args, labels=labels, fused_lm_head=True, **kwargs)
        out = self.policy(*args, labels=labels, fused_lm_head=True, **kwargs)
        mask = (labels[:, 1:] != -100).long()
        width = mask.shape[1]
        policy_logps, ref_logps = out.log_probs[:, -width:], ref_out.log_probs[:, -width:].detach()
        humanline_logps = self.humanline_logps(policy_logps, ref_logps, mask)
        if out.log_sum_sq_probs is not None:  # DPO's use_weighting: TRL's weights stay the policy's own
            shift = (humanline_logps - policy_logps).detach()
            out.log_sum_sq_probs = torch.cat([out.log_sum_sq_probs[:, :-width],
                                              out.log_sum_sq_probs[:, -width:] + shift], dim=1)
        out.log_probs = torch.cat([out.log_probs[:, :-width], humanline_logps], dim=1)
        return out


def compute_loss_on_pair(trainer, trl_compute_loss, model, inputs, return_outputs):
    """Call TRL's ``_compute_loss`` (``trl_compute_loss``, bound) with the stand-ins of `FusedPair` or, on a TRL
    without the fused LM head, of ``logits.LogitsPair``.

    ``trainer.ref_model`` is the reference stand-in for the call's duration only (``hl_core.swaps.swap``). The
    clipped fraction counted is that of the last transformed forward: the completions (KTO's mismatched rows come
    first).
    """
    if fused_head_available():
        pair, patch = FusedPair(trainer, model, trainer._humanline_reference(model)), contextlib.nullcontext()
    else:
        trl_class = getattr(trl, trainer._trl_trainer)
        pair = LogitsPair(trainer, model, trainer._humanline_reference(model), trl_log_prob_functions(trl_class))
        patch = patched_log_probs(trl_class, pair)
    with swap(trainer, "ref_model", pair.reference_forward), patch:
        out = trl_compute_loss(pair.policy_forward, inputs, return_outputs)
    trainer._humanline_count(pair.metrics[-1])
    return out
