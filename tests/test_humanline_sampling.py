"""Humanline sampling: Beta draws, the two-sided rejection mask, the ``sample`` transform."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from hl_core.humanline import SampleTransform
from hl_core.humanline.functional import log_beta_sample, rejection_mask
from hl_core.humanline.recipe import build_transform, transform_names


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------- Beta draws


@pytest.mark.parametrize("a,b", [(0.5, 1.0), (2.0, 3.0), (0.3, 2.5), (1.0, 1.0)])
def test_log_beta_sample_matches_scipy_beta(a, b):
    u = log_beta_sample((20000,), a, b, _gen(11)).exp().numpy()
    assert u.dtype == np.float64 and np.all((u >= 0) & (u <= 1))
    assert stats.kstest(u, stats.beta(a, b).cdf).pvalue > 1e-3


def test_log_beta_sample_tiny_shape_stays_finite_in_log_space():
    # Beta(0.01, 1): P(u < 1e-38) = (1e-38)**0.01 ~ 0.417; in linear float32 these would all be 0
    n = 20000
    log_u = log_beta_sample((n,), 0.01, 1.0, _gen(5))
    assert torch.all(torch.isfinite(log_u))
    p = 1e-38**0.01
    frac = (log_u < math.log(1e-38)).double().mean().item()
    assert abs(frac - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_log_beta_sample_rejects_bad_parameters():
    with pytest.raises(ValueError):
        log_beta_sample((3,), 0.0, 1.0)


# ---------------------------------------------------------------------------- rejection mask


def _logps(seed, B=4, T=16):
    g = _gen(seed)
    ref = -torch.rand(B, T, generator=g) * 5
    pol = ref + torch.randn(B, T, generator=g)
    mask = torch.ones(B, T)
    mask[:, 12:] = 0
    mask[2, 5:] = 0
    return pol * mask, ref * mask, mask


def test_rejection_mask_reproducible_and_fresh_each_call():
    pol, ref, mask = _logps(0)
    kw = dict(gamma_P=0.5, gamma_R=0.5, beta_P=1.0, beta_R=2.0)
    g1, g2 = _gen(123), _gen(123)
    first = rejection_mask(pol, ref, mask, generator=g1, **kw)
    assert torch.equal(first, rejection_mask(pol, ref, mask, generator=g2, **kw))
    second = rejection_mask(pol, ref, mask, generator=g1, **kw)
    assert not torch.equal(first, second)
    assert first.dtype == torch.bool and first.shape == pol.shape


def test_masked_tokens_never_rejected_and_do_not_set_the_max():
    pol, ref, mask = _logps(1)
    pol = pol + 50.0 * (1 - mask)  # huge ratios under the mask
    ref = ref - 80.0 * (1 - mask)
    m = mask.bool()
    gamma = 0.05
    # with beta = 1 on both sides, P(accept) = exp(-gamma * (max d - min d)) over the real tokens:
    # about 0.8 here, but about exp(-gamma * 130) ~ 0.001 if the masked tokens set M
    d = (pol - ref)[m]
    p_accept = math.exp(-gamma * (d.max() - d.min()).item())
    assert p_accept > 0.7
    accepted = []
    for seed in range(5):
        rejected = rejection_mask(pol, ref, mask, gamma_P=gamma, gamma_R=gamma, generator=_gen(seed))
        assert not rejected[~m].any()
        accepted.append((~rejected[m]).double().mean().item())
    assert np.mean(accepted) > 0.5
    assert not rejection_mask(pol, ref, torch.zeros_like(mask), generator=_gen(0)).any()


@pytest.mark.parametrize(
    "gamma_P,gamma_R,beta_P,beta_R",
    [(0.5, 0.01, 1.0, 1.0), (2.0, 0.7, 3.0, 1.5)],
    ids=["defaults", "general-beta"],
)
def test_rejection_rate_matches_beta_cdf(gamma_P, gamma_R, beta_P, beta_R):
    levels = np.array([-0.6, -0.2, 0.0, 0.3, 0.7])  # d = lp_pol - lp_ref
    per_level = 20000
    d = torch.tensor(np.repeat(levels, per_level)).reshape(len(levels), per_level)
    ref = torch.full_like(d, -3.0)
    pol = ref + d
    # extra masked column with extreme ratios: must not change M or be rejected
    pol = torch.cat([pol, torch.full((len(levels), 1), 40.0, dtype=torch.float64)], dim=1)
    ref = torch.cat([ref, torch.full((len(levels), 1), -40.0, dtype=torch.float64)], dim=1)
    mask = torch.ones_like(pol)
    mask[:, -1] = 0
    rejected = rejection_mask(pol, ref, mask, gamma_P, gamma_R, beta_P, beta_R, generator=_gen(2024))
    assert not rejected[:, -1].any()

    log_M_R, log_M_P = (-levels).max(), levels.max()
    for i, level in enumerate(levels):
        # accepted iff u_R <= r_R / M_R and u_P <= r_P / M_P, independent draws
        p_accept = stats.beta(gamma_R, beta_R).cdf(math.exp(-level - log_M_R)) * stats.beta(gamma_P, beta_P).cdf(
            math.exp(level - log_M_P)
        )
        p = 1.0 - p_accept
        rate = rejected[i, :-1].double().mean().item()
        se = math.sqrt(max(p * (1 - p), 1e-12) / per_level)
        assert abs(rate - p) <= 4 * se + 1e-12, (level, rate, p)  # 4 standard errors, fixed seed


# --------------------------------------------------------------------------------- transform


def test_sample_transform_detaches_rejected_tokens_only():
    pol, ref, mask = _logps(3)
    pol = pol.double().requires_grad_(True)
    ref, mask = ref.double(), mask.double()
    transform = SampleTransform(gamma_P=0.5, gamma_R=0.3, beta_P=1.0, beta_R=1.0, seed=7)
    out, metrics = transform(pol, ref, mask)
    rejected = rejection_mask(pol, ref, mask, 0.5, 0.3, 1.0, 1.0, generator=_gen(7))  # same first draw
    m = mask.bool()
    assert rejected.any() and (~rejected & m).any()
    # forward: every token keeps its log-ratio (rejected or not), zero under the mask
    expected = ((pol - ref) * mask).detach()
    assert torch.equal(out.detach(), expected)
    weights = torch.randn(pol.shape, generator=_gen(9), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out * weights).sum(), pol)
    assert torch.all(grad[rejected] == 0)
    assert torch.all(grad[~m] == 0)
    assert torch.equal(grad[~rejected & m], weights[~rejected & m])
    n = m.sum().item()
    assert metrics["rejected_frac"] == pytest.approx(rejected.sum().item() / n)
    assert metrics["unclamped_frac"] == pytest.approx((~rejected & m).sum().item() / n)


def test_sample_transform_seeded_runs_repeat_and_draws_advance():
    pol, ref, mask = _logps(4)
    pol = pol.requires_grad_(True)

    def grad_pattern(transform):
        out, _ = transform(pol, ref, mask)
        (grad,) = torch.autograd.grad(out.sum(), pol)
        return grad != 0

    a, b = SampleTransform(0.5, 0.5, 1.0, 1.0, seed=1), SampleTransform(0.5, 0.5, 1.0, 1.0, seed=1)
    first_a, first_b = grad_pattern(a), grad_pattern(b)
    assert torch.equal(first_a, first_b)
    assert not torch.equal(first_a, grad_pattern(a))


def test_sample_transform_registered():
    assert "sample" in transform_names()
    cfg = SimpleNamespace(transform="sample", gamma_P=0.4, gamma_R=0.02, beta_P=1.5, beta_R=2.0)
    transform = build_transform(cfg, seed=3)
    assert isinstance(transform, SampleTransform)
    assert (transform.gamma_P, transform.gamma_R, transform.beta_P, transform.beta_R, transform.seed) == (
        0.4,
        0.02,
        1.5,
        2.0,
        3,
    )
    with pytest.raises(ValueError):
        SampleTransform(gamma_P=0.0)
