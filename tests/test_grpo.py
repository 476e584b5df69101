"""GRPO: group advantages, clipped surrogate + k3 loss, gradients, double clipping."""

import math

import numpy as np
import pytest
import torch

from hl_core.humanline.functional import clip_log_ratio
from hl_core.objectives import OBJECTIVES, group_advantages, grpo_loss


def test_group_advantages_match_numpy_population_std():
    rng = np.random.default_rng(0)
    group_ids = np.array([7, -3, 7, 100, -3, 7, 100, 42, 7, -3])  # 42 is a group of one
    scores = rng.normal(size=group_ids.shape[0])
    eps = 1e-4
    expected = np.zeros_like(scores)
    for g in np.unique(group_ids):
        idx = group_ids == g
        expected[idx] = (scores[idx] - scores[idx].mean()) / (scores[idx].std(ddof=0) + eps)
    got = group_advantages(torch.tensor(scores), torch.tensor(group_ids), eps=eps)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)
    assert got[7].item() == 0.0
    # population std of [1, 3] is 1, so +-1 (the sample std would give +-0.707)
    two = group_advantages(torch.tensor([1.0, 3.0], dtype=torch.float64), torch.tensor([5, 5]), eps=0.0)
    np.testing.assert_allclose(two.numpy(), [-1.0, 1.0])


def test_group_advantages_equal_scores_give_zero():
    adv = group_advantages(torch.tensor([2.0, 2.0, 2.0, 1.0, 0.0]), torch.tensor([1, 1, 1, 9, 9]))
    assert torch.all(adv[:3] == 0)
    assert adv[3].item() == pytest.approx(1.0 / (1.0 + 2e-4), rel=1e-6)


def _reference(lr, mask, adv, eps_low, eps_high, ref_lr, beta_kl, aggregation, tokens_per_rank=None):
    """Independent float64 loss, d loss/d logratios and d loss/d ref_logratios, token by token (``dapo``:
    each token weighs 1 / ``tokens_per_rank``, the mean completion tokens per rank over all ranks)."""
    B, T = lr.shape
    n_tokens = mask.sum()
    loss = 0.0
    g_lr, g_ref = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        n_b = mask[b].sum()
        for t in range(T):
            if not mask[b, t]:
                continue
            w = {"token": 1.0 / n_tokens, "sequence": 1.0 / (B * n_b), "dapo": 1.0
                 / (tokens_per_rank or 1.0)}[aggregation]
            rho, A = math.exp(lr[b, t]), adv[b]
            clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
            x = ref_lr[b, t]
            k3 = math.exp(-x) + x - 1.0
            loss += w * (-min(rho * A, clipped * A) + beta_kl * k3)
            g_lr[b, t] = w * (-A * rho) if rho * A <= clipped * A else 0.0
            g_ref[b, t] = w * beta_kl * (1.0 - math.exp(-x))
    return loss, g_lr, g_ref


def _batch(seed=0, B=5, T=8):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 3, 5, 1, 6])[:B]
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    lr = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4 * mask
    ref_lr = (lr + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)) * mask
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.9], dtype=torch.float64)[:B]
    return lr, ref_lr, mask, adv


@pytest.mark.parametrize("aggregation", ["token", "sequence", "dapo"])
@pytest.mark.parametrize("beta_kl", [0.0, 0.05])
def test_grpo_loss_and_grads_match_formula(aggregation, beta_kl):
    lr, ref_lr, mask, adv = _batch()
    lr.requires_grad_(True)
    ref_lr.requires_grad_(True)
    eps_low, eps_high = 0.1, 0.3
    # dapo: as if the other ranks' micro-batches held more tokens (this one holds 23; mean over ranks 31.5)
    per_rank = 31.5 if aggregation == "dapo" else None
    loss, metrics = grpo_loss(lr, mask, adv, eps_low, eps_high, ref_lr, beta_kl, aggregation, tokens_per_rank=per_rank)
    g_lr, g_ref = torch.autograd.grad(loss, [lr, ref_lr], allow_unused=True)
    exp_loss, exp_g_lr, exp_g_ref = _reference(
        lr.detach().numpy(), mask.numpy(), adv.numpy(), eps_low, eps_high, ref_lr.detach().numpy(), beta_kl,
        aggregation,
        per_rank,
    )
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    np.testing.assert_allclose(g_lr.numpy(), exp_g_lr, rtol=1e-10, atol=1e-15)
    if beta_kl > 0:
        np.testing.assert_allclose(g_ref.numpy(), exp_g_ref, rtol=1e-10, atol=1e-15)
    else:
        assert g_ref is None or torch.all(g_ref == 0)

    # the batch exercises both PPO clip sides and the unclipped branch
    rho, m, A = lr.detach().exp(), mask.bool(), adv[:, None]
    low = (rho < 1 - eps_low) & (A < 0) & m
    high = (rho > 1 + eps_high) & (A > 0) & m
    assert low.sum() > 0 and high.sum() > 0 and (exp_g_lr != 0).sum() > 5
    n = m.sum().item()
    assert metrics["clip/low_frac"] == pytest.approx(low.sum().item() / n)
    assert metrics["clip/high_frac"] == pytest.approx(high.sum().item() / n)
    assert metrics["ratio/mean"] == pytest.approx(rho[m].mean().item())
    x = ref_lr.detach()[m]
    assert metrics["kl/mean"] == pytest.approx((torch.exp(-x) + x - 1).mean().item())
    assert metrics["advantages/mean"] == pytest.approx(adv.mean().item())
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())  # on the device: no host read


def test_grpo_aggregations_differ_on_ragged_batch():
    lr, ref_lr, mask, adv = _batch(seed=4)
    token, _ = grpo_loss(lr, mask, adv, aggregation="token")
    sequence, _ = grpo_loss(lr, mask, adv, aggregation="sequence")
    assert abs(token.item() - sequence.item()) > 1e-4


def test_grpo_double_clip_and_humanline_clip_zero_gradient():
    log_eps_P, log_eps_R = -0.1, 1.0
    eps = 0.2
    # tokens:                  a: both clips   b: PPO only   c: humanline only   d: below log_eps_P   e: inside
    d_raw = torch.tensor([[2.0, 0.5, 1.5, -0.5, 0.05]], dtype=torch.float64)
    adv_per_token = [1.0, 1.0, -1.0, 1.0, 1.0]
    pol = torch.zeros(5, 1, dtype=torch.float64, requires_grad=True)
    ref = -d_raw.reshape(5, 1)
    mask = torch.ones(5, 1, dtype=torch.float64)
    d_hl = clip_log_ratio(pol - ref, log_eps_P, log_eps_R) * mask  # one token per sequence
    adv = torch.tensor(adv_per_token, dtype=torch.float64)
    loss, metrics = grpo_loss(d_hl, mask, adv, eps, eps, aggregation="token")
    (grad,) = torch.autograd.grad(loss, pol)
    grad = grad.reshape(-1)
    assert torch.all(grad[:4] == 0)
    assert grad[4].item() == pytest.approx(-1.0 * math.exp(0.05) / 5)
    assert metrics["clip/high_frac"] == pytest.approx(2 / 5)  # a (e^1 > 1.2) and b (e^0.5 > 1.2)


def test_grpo_k3_uses_unclamped_log_ratio():
    log_eps_P, log_eps_R = -0.1, 1.0
    d_raw = torch.tensor([[2.0, -0.5, 0.05]], dtype=torch.float64)
    pol = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    ref = -d_raw
    mask = torch.ones(1, 3, dtype=torch.float64)
    raw = pol - ref
    d_hl = clip_log_ratio(raw, log_eps_P, log_eps_R) * mask
    adv = torch.tensor([0.0], dtype=torch.float64)  # isolate the KL term
    beta_kl = 0.3
    loss, metrics = grpo_loss(d_hl, mask, adv, ref_logratios=raw, beta_kl=beta_kl)
    (grad,) = torch.autograd.grad(loss, pol)
    x = d_raw.reshape(-1).numpy()
    k3_unclamped = np.exp(-x) + x - 1
    xc = np.clip(x, log_eps_P, log_eps_R)
    k3_clamped = np.exp(-xc) + xc - 1
    assert abs(k3_unclamped.mean() - k3_clamped.mean()) > 0.1
    assert loss.item() == pytest.approx(beta_kl * k3_unclamped.mean(), rel=1e-12)
    assert metrics["kl/mean"] == pytest.approx(k3_unclamped.mean(), rel=1e-12)
    # the clamped tokens still get the KL gradient (it flows through the unclamped ratio)
    np.testing.assert_allclose(grad.reshape(-1).numpy(), beta_kl * (1 - np.exp(-x)) / 3, rtol=1e-12)


def test_grpo_masked_positions_ignored_even_if_garbage():
    lr, ref_lr, mask, adv = _batch(seed=2)
    clean, _ = grpo_loss(lr, mask, adv, ref_logratios=ref_lr, beta_kl=0.1)
    garbage = 1000.0 * (1 - mask)
    dirty, _ = grpo_loss(lr + garbage, mask, adv, ref_logratios=ref_lr - garbage, beta_kl=0.1)
    assert torch.isfinite(dirty) and dirty.item() == pytest.approx(clean.item(), rel=1e-12)


def test_grpo_argument_errors():
    lr, ref_lr, mask, adv = _batch()
    with pytest.raises(ValueError, match="ref_logratios"):
        grpo_loss(lr, mask, adv, beta_kl=0.1)
    with pytest.raises(ValueError, match="aggregation"):
        grpo_loss(lr, mask, adv, aggregation="sample")


def test_grpo_registered_as_grouped():
    assert OBJECTIVES["grpo"].loss_fn is grpo_loss and OBJECTIVES["grpo"].data_kind == "grouped"
