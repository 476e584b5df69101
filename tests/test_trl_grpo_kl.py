"""GRPO's terms that read the old policy, with humanline's synced reference in its place, against the pack's own GRPO
(``hl_core.objectives.grpo``: ``grpo_loss``, ``k3_divergence``, ``group_advantages``) on log-probs computed here
from the logits, loss and gradients within 1e-5 (beta = 0.04, a reference the policy differs from, bounds that bind
on some tokens and not others):

* ``use_bias_correction_kl=False``: ``beta * k3`` of the unclamped log-ratio, the pack's term exactly;
* ``use_bias_correction_kl=True`` (TRL's default): TRL's importance weight on it, humanline's ratio ``exp(d_hl)``:
  ``beta * k3 * exp(d_hl)``, differentiated through the weight as TRL does;
* ``off_policy_mask_threshold=delta``: a sequence with a negative advantage is dropped when its mean unclamped
  ``lp_ref - lp_pol`` exceeds ``delta``; the dropped tokens still count in the token mean's denominator (TRL's).
Each comparison can fail: the other variant's value differs from it.
"""

import pytest
import torch

from trl_common import grpo

trl = pytest.importorskip("trl")

from distributed.trl_data import load  # noqa: E402
from hl_core.humanline import ClipTransform  # noqa: E402
from hl_core.objectives.grpo import group_advantages, grpo_loss, k3_divergence  # noqa: E402

BETA, BOUNDS, EPS = 0.04, (-0.3, 0.3), 0.2


def perturbed(weights, scale=0.02):
    model = load(weights)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def trl_loss_and_grads(weights, tmp_path, **args):
    """TRL's ``_compute_loss`` through the humanline trainer on one batch of 2 offline groups, with a frozen
    reference the policy differs from; the batch, the loss and the policy's gradients."""
    trainer = grpo(weights, tmp_path, ref_model=perturbed(weights), transform=ClipTransform(*BOUNDS), schedule=None,
                   args={"beta": BETA, "epsilon": EPS, **args})
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    rows = [trainer.train_dataset[i] for i in range(8)]
    inputs = trainer._generate_and_score_completions(rows)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
    return inputs, float(loss), grads


def completion_logps(model, inputs):
    """Per-token log-probs of the completion tokens from the logits (computed here, not by TRL)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    width = inputs["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1].float()
    return torch.gather(logits.log_softmax(-1), 2, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)


def scores(weights):
    """The scores of the batch's 8 completions (2 groups of 4), as the data holds them."""
    from transformers import AutoTokenizer

    from distributed.trl_data import grpo_rows

    return torch.tensor(grpo_rows(AutoTokenizer.from_pretrained(weights)).select(range(8))["score"])


def expected_loss_and_grads(weights, inputs, bias_correction=False, delta=None):
    """The pack's GRPO on log-probs computed here; with ``bias_correction`` the KL term weighted by ``exp(d_hl)``,
    with ``delta`` the off-policy mask against the reference."""
    policy, reference = load(weights), perturbed(weights)
    mask = inputs["completion_mask"].float()
    lp = completion_logps(policy, inputs)
    with torch.no_grad():
        lp_ref = completion_logps(reference, inputs)
    d = (lp - lp_ref) * mask
    d_hl = torch.clamp(lp - lp_ref, *BOUNDS) * mask
    advantages = group_advantages(scores(weights), torch.arange(mask.shape[0]) // 4, eps=1e-4)
    assert torch.allclose(advantages, inputs["advantages"])
    keep = torch.ones(mask.shape[0])
    if delta is not None:
        drift = ((lp_ref - lp).detach() * mask).sum(-1) / mask.sum(-1)
        keep = ((advantages >= 0) | (drift <= delta)).float()
    kept = mask * keep[:, None]
    policy_part, _ = grpo_loss(d_hl, kept, advantages, eps_low=EPS, eps_high=EPS, aggregation="token")
    policy_part = policy_part * kept.sum() / mask.sum()  # TRL's token mean: dropped tokens stay in the denominator
    weight = torch.exp(d_hl) if bias_correction else torch.ones_like(d_hl)
    kl = BETA * (k3_divergence(d) * weight * mask).sum() / mask.sum()
    loss = policy_part + kl
    loss.backward()
    return float(loss), {n: p.grad for n, p in policy.named_parameters()}, keep, d, d_hl, mask


def max_grad_gap(a, b):
    return max(float((a[n] - b[n]).abs().max()) for n in a) / max(float(g.abs().max()) for g in b.values())


@pytest.mark.parametrize("bias_correction", [False, True], ids=["plain-k3", "bias-corrected"])
def test_grpos_kl_term_equals_the_packs_definition(bias_correction, weights, tmp_path):
    inputs, loss, grads = trl_loss_and_grads(weights, tmp_path, use_bias_correction_kl=bias_correction)
    want, want_grads, _, d, d_hl, mask = expected_loss_and_grads(weights, inputs, bias_correction)
    clipped = float(((d != d_hl) & mask.bool()).sum() / mask.sum())
    other, *_ = expected_loss_and_grads(weights, inputs, not bias_correction)
    print(f"bias correction {bias_correction}: |loss - pack| {abs(loss - want):.2e}, max relative gradient gap "
          f"{max_grad_gap(grads, want_grads):.2e}, clipped {clipped:.2f}, other variant off by {abs(loss - other):.2e}")
    assert 0.05 < clipped < 0.95  # the bounds bind on some tokens, not all
    assert abs(loss - want) <= 1e-5 and max_grad_gap(grads, want_grads) <= 1e-5
    assert abs(loss - other) > 1e-5  # the two variants differ here: the comparison can fail


def test_the_off_policy_mask_drops_negative_advantage_sequences_that_drifted_from_the_reference(weights,  # noqa
                                                                                               tmp_path):
    inputs, *_ = trl_loss_and_grads(weights, tmp_path / "probe", use_bias_correction_kl=False)
    _, _, _, d, _, mask = expected_loss_and_grads(weights, inputs)
    drift = (-d * mask).sum(-1) / mask.sum(-1)
    negative = drift[inputs["advantages"] < 0].sort().values
    delta = float((negative[0] + negative[-1]) / 2)  # drops some negative-advantage sequences, keeps others
    inputs, loss, grads = trl_loss_and_grads(weights, tmp_path / "mask", use_bias_correction_kl=False,
                                             off_policy_mask_threshold=delta)
    want, want_grads, keep, *_ = expected_loss_and_grads(weights, inputs, delta=delta)
    unmasked, *_ = expected_loss_and_grads(weights, inputs)
    print(f"off-policy mask at delta {delta:.4f}: kept {int(keep.sum())} of {len(keep)} sequences, |loss - pack| "
          f"{abs(loss - want):.2e}, max relative gradient gap {max_grad_gap(grads, want_grads):.2e}")
    assert 0 < int(keep.sum()) < len(keep)
    assert abs(loss - want) <= 1e-5 and max_grad_gap(grads, want_grads) <= 1e-5
    assert abs(loss - unmasked) > 1e-5
