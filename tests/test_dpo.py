"""DPO loss and gradients against a hand-written formula; clipped tokens get exactly zero gradient."""

import math

import pytest
import torch

from hl_core.humanline import ClipTransform, NoTransform
from hl_core.humanline.functional import clip_log_ratio, unclamped_fraction
from hl_core.objectives.dpo import dpo_loss


def _hand_dpo(chosen, chosen_mask, rejected, rejected_mask, beta):
    """Independent per-pair loop: -log(sigmoid(beta * (sum_c - sum_r)))."""
    losses = []
    for b in range(chosen.shape[0]):
        s_c = sum(float(chosen[b, t]) for t in range(chosen.shape[1]) if chosen_mask[b, t])
        s_r = sum(float(rejected[b, t]) for t in range(rejected.shape[1]) if rejected_mask[b, t])
        z = beta * (s_c - s_r)
        losses.append(math.log1p(math.exp(-z)))
    return sum(losses) / len(losses)


def test_dpo_loss_matches_hand_formula():
    gen = torch.Generator().manual_seed(0)
    chosen = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    rejected = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    chosen_mask = (torch.rand(4, 7, generator=gen) > 0.3).long()
    rejected_mask = (torch.rand(4, 5, generator=gen) > 0.3).long()
    loss, metrics = dpo_loss(chosen, chosen_mask, rejected, rejected_mask, beta=0.3)
    assert loss.item() == pytest.approx(_hand_dpo(chosen, chosen_mask, rejected, rejected_mask, 0.3), abs=1e-12)
    assert set(metrics) >= {"rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy"}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())  # on the device: no host read


def test_dpo_gradient_matches_hand_derivative():
    """d loss / d chosen[b, t] = -beta * sigmoid(-z_b) * mask / B; the opposite sign for rejected."""
    gen = torch.Generator().manual_seed(1)
    B, T, beta = 3, 6, 0.1
    chosen = torch.randn(B, T, generator=gen, dtype=torch.float64, requires_grad=True)
    rejected = torch.randn(B, T, generator=gen, dtype=torch.float64, requires_grad=True)
    cm = (torch.rand(B, T, generator=gen) > 0.4).double()
    rm = (torch.rand(B, T, generator=gen) > 0.4).double()
    loss, _ = dpo_loss(chosen, cm, rejected, rm, beta=beta)
    g_c, g_r = torch.autograd.grad(loss, (chosen, rejected))
    for b in range(B):
        z = beta * (float((chosen[b] * cm[b]).sum().detach()) - float((rejected[b] * rm[b]).sum().detach()))
        coef = beta / (1 + math.exp(z)) / B  # beta * sigmoid(-z) / B
        for t in range(T):
            assert g_c[b, t].item() == pytest.approx(-coef * cm[b, t].item(), abs=1e-12)
            assert g_r[b, t].item() == pytest.approx(coef * rm[b, t].item(), abs=1e-12)


def test_equal_policy_and_reference_gives_ln2():
    lp = torch.randn(2, 5)
    transform = ClipTransform()
    d, _ = transform(lp, lp.clone(), torch.ones(2, 5))
    loss, metrics = dpo_loss(d[:1], torch.ones(1, 5), d[1:], torch.ones(1, 5))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    assert metrics["rewards/margin"] == 0.0


def test_clipped_tokens_get_exactly_zero_gradient():
    """Tokens whose log-ratio is outside [log_eps_P, log_eps_R] contribute their bound and no gradient."""
    policy = torch.tensor([[0.0, 3.0, -4.0, 0.5, -0.2, 9.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.zeros_like(policy)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    transform = ClipTransform(-1.5, 1.5)
    d, metrics = transform(policy, ref, mask)
    assert d.tolist() == [[0.0, 1.5, -1.5, 0.5, -0.2, 0.0]]
    # strictly inside (-1.5, 1.5) among the 5 unmasked tokens: 0.0, 0.5, -0.2
    assert metrics["unclamped_frac"] == pytest.approx(3 / 5)
    other = torch.zeros(1, 6, dtype=torch.float64)
    loss, _ = dpo_loss(d, mask, other, mask, beta=0.1)
    (grad,) = torch.autograd.grad(loss, policy)
    inside = [True, False, False, True, True, False]
    for t, keep in enumerate(inside):
        if keep:
            assert grad[0, t].item() != 0.0
        else:
            assert grad[0, t].item() == 0.0  # exactly zero: clamped or masked


def test_clip_bounds_are_asymmetric_and_validated():
    x = torch.tensor([-2.0, -0.5, 0.3, 2.0])
    assert clip_log_ratio(x, -0.1, 1.0).tolist() == pytest.approx([-0.1, -0.1, 0.3, 1.0])
    with pytest.raises(ValueError):
        clip_log_ratio(x, 0.5, 1.0)
    assert unclamped_fraction(x, torch.ones(4), -0.1, 1.0) == pytest.approx(0.25)


def test_no_transform_is_plain_masked_log_ratio():
    policy, ref = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    d, _ = NoTransform()(policy, ref, mask)
    assert torch.equal(d, (policy - ref) * mask)
