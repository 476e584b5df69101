"""KTO loss, gradients, reference point z0 (incl. a real 2-process gloo all-reduce), mismatched pairs."""

import datetime
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port
from hl_core.humanline.functional import clip_log_ratio
from hl_core.objectives import OBJECTIVES, kto_loss, kto_reference_point, mismatched_pairs


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _reference(lr, mask, desirable, z0, beta, w_d, w_u):
    """Independent float64 loss and d loss / d logratios."""
    lr, mask, desirable = np.asarray(lr, np.float64), np.asarray(mask, np.float64), np.asarray(desirable, bool)
    B = lr.shape[0]
    losses, dldr = np.zeros(B), np.zeros(B)
    for b in range(B):
        r = float((lr[b] * mask[b]).sum())
        if desirable[b]:
            s = _sigmoid(beta * (r - z0))
            losses[b] = w_d * (1.0 - s)
            dldr[b] = -w_d * beta * s * (1.0 - s)
        else:
            s = _sigmoid(beta * (z0 - r))
            losses[b] = w_u * (1.0 - s)
            dldr[b] = w_u * beta * s * (1.0 - s)
    return losses.mean(), dldr[:, None] * mask / B


def _batch(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(B, T, generator=g, dtype=torch.float64) * 2.0
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float64)
    return lr * mask, mask


@pytest.mark.parametrize("labels", [[1, 0, 1, 1, 0, 0], [1] * 6, [0] * 6], ids=["mixed", "desirable", "undesirable"])
def test_kto_loss_and_grad_match_formula(labels):
    lr, mask = _batch()
    lr.requires_grad_(True)
    desirable = torch.tensor(labels, dtype=torch.bool)
    beta, w_d, w_u, z0 = 0.7, 1.3, 0.6, 0.45
    loss, metrics = kto_loss(lr, mask, desirable, torch.tensor(z0, dtype=torch.float64), beta, w_d, w_u)
    (grad,) = torch.autograd.grad(loss, lr)
    ref_loss, ref_grad = _reference(lr.detach().numpy(), mask.numpy(), labels, z0, beta, w_d, w_u)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-10, atol=1e-14)
    assert np.abs(ref_grad).max() > 1e-4  # the test can fail: gradients are non-trivial

    sums = (lr.detach() * mask).sum(-1).numpy()
    d = np.asarray(labels, bool)
    assert metrics["kto/z0"] == pytest.approx(z0)
    assert metrics["count/desirable"] == d.sum() and metrics["count/undesirable"] == (~d).sum()
    if d.any():
        assert metrics["rewards/desirable"] == pytest.approx(beta * sums[d].mean())
    else:
        assert "rewards/desirable" not in metrics
    if (~d).any():
        assert metrics["rewards/undesirable"] == pytest.approx(beta * sums[~d].mean())
    else:
        assert "rewards/undesirable" not in metrics
    # counts are host numbers (from the labels), the rest 0-dim device tensors
    assert all(isinstance(v, float) or (isinstance(v, torch.Tensor) and v.dim() == 0) for v in metrics.values())
    assert all(math.isfinite(float(v)) for v in metrics.values())


def test_kto_z0_is_not_differentiated():
    lr, mask = _batch()
    z0 = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    loss, _ = kto_loss(lr.requires_grad_(True), mask, torch.tensor([1, 0, 1, 0, 1, 0]).bool(), z0)
    grad_lr, grad_z0 = torch.autograd.grad(loss, [lr, z0], allow_unused=True)
    assert grad_z0 is None and grad_lr is not None


def test_kto_float_z0_and_default_hyperparameters():
    lr, mask = _batch(seed=3)
    labels = [0, 1, 1, 0, 1, 0]
    loss, _ = kto_loss(lr, mask, torch.tensor(labels).bool(), 0.2)
    ref_loss, _ = _reference(lr.numpy(), mask.numpy(), labels, 0.2, 0.1, 1.0, 1.0)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-12)


def test_kto_clipped_tokens_get_zero_gradient():
    log_eps_P, log_eps_R = -0.5, 0.8
    g = torch.Generator().manual_seed(1)
    ref = torch.randn(4, 9, generator=g, dtype=torch.float64) - 2.0
    pol = (ref + torch.randn(4, 9, generator=g, dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones(4, 9, dtype=torch.float64)
    mask[1, 6:] = 0
    d_hl = clip_log_ratio(pol - ref, log_eps_P, log_eps_R) * mask
    labels = [1, 0, 0, 1]
    loss, _ = kto_loss(d_hl, mask, torch.tensor(labels).bool(), 0.1, beta=0.5)
    (grad,) = torch.autograd.grad(loss, pol)
    raw = (pol - ref).detach()
    inside = (raw > log_eps_P) & (raw < log_eps_R) & mask.bool()
    clipped = ~inside & mask.bool()
    assert clipped.sum() > 5 and inside.sum() > 5
    assert torch.all(grad[clipped] == 0)
    assert torch.all(grad[~mask.bool()] == 0)
    _, ref_grad = _reference(d_hl.detach().numpy(), mask.numpy(), labels, 0.1, 0.5, 1.0, 1.0)
    np.testing.assert_allclose(grad[inside].numpy(), ref_grad[inside.numpy()], rtol=1e-10)
    assert torch.all(grad[inside] != 0)


def test_kto_registered_as_unpaired():
    assert OBJECTIVES["kto"].loss_fn is kto_loss and OBJECTIVES["kto"].data_kind == "unpaired"


# ----------------------------------------------------------------------------------------- z0


def _z0_by_hand(kl, mask):
    sums = [float(sum(kl[b][t] * mask[b][t] for t in range(len(kl[b])))) for b in range(len(kl))]
    nonzero = [s for s in sums if s != 0.0]
    return max(0.0, sum(sums) / len(nonzero)) if nonzero else 0.0


def _kl_batch():
    kl = torch.tensor(
        [
            [0.5, 0.2, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],  # zero-sum sequence (all padding): not counted
            [1.5, -0.3, 0.4, 0.9],
            [-0.2, 0.1, 0.0, 0.0],
            [0.7, 0.6, 0.5, 0.0],
            [2.0, 0.0, 0.0, 0.0],
        ],
        dtype=torch.float64,
    )
    mask = (kl != 0).to(torch.float64)
    mask[2, :] = 1
    return kl, mask


def test_z0_mean_over_nonzero_sequences():
    kl, mask = _kl_batch()
    z0 = kto_reference_point(kl, mask)
    expected = _z0_by_hand(kl.tolist(), mask.tolist())
    assert expected == pytest.approx((0.7 + 2.5 - 0.1 + 1.8 + 2.0) / 5)
    assert z0.item() == pytest.approx(expected, abs=1e-12)
    assert z0.dim() == 0


def test_z0_ignores_masked_positions():
    kl, mask = _kl_batch()
    garbage = kl + 100.0 * (1 - mask)  # values under the mask must not count
    assert kto_reference_point(garbage, mask).item() == pytest.approx(kto_reference_point(kl, mask).item())


def test_z0_floored_at_zero_and_zero_when_empty():
    kl, mask = _kl_batch()
    assert kto_reference_point(-kl - 1.0, mask).item() == 0.0
    assert kto_reference_point(torch.zeros(3, 4), torch.zeros(3, 4)).item() == 0.0


def test_z0_detached():
    kl, mask = _kl_batch()
    kl.requires_grad_(True)
    z0 = kto_reference_point(kl * 1.0, mask)
    assert not z0.requires_grad and z0.grad_fn is None


def _z0_worker(rank, world_size, port, kl, mask, out_path):
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        half = kl.shape[0] // world_size
        rows = slice(rank * half, (rank + 1) * half)
        z0 = kto_reference_point(kl[rows], mask[rows])
        if rank == 0:
            with open(out_path, "w") as f:
                f.write(repr(float(z0)))
    finally:
        dist.destroy_process_group()


def test_z0_two_processes_equals_single_process(tmp_path):
    kl, mask = _kl_batch()  # rank 0 holds rows 0-2 (one zero-sum row), rank 1 rows 3-5
    single = kto_reference_point(kl, mask).item()
    local_rank0 = kto_reference_point(kl[:3], mask[:3]).item()
    assert abs(single - local_rank0) > 1e-3  # without the all-reduce the answer would differ
    out = tmp_path / "z0.txt"
    mp.spawn(_z0_worker, args=(2, free_port(), kl, mask, str(out)), nprocs=2, join=True)
    assert float(out.read_text()) == pytest.approx(single, abs=1e-6)


# ------------------------------------------------------------------------------ mismatched pairs


def test_mismatched_pairs_circular_shift():
    prompts = [[1, 2], [3], [4, 5, 6]]
    completions = [[10], [11, 12], [13, 14, 15]]
    shifted_prompts, shifted_completions, same = mismatched_pairs(prompts, completions)
    assert shifted_prompts == prompts
    assert shifted_completions == [[11, 12], [13, 14, 15], [10]]
    assert same == [False, False, False]
    shifted_completions[0].append(99)  # copies, not views of the input
    assert completions[1] == [11, 12]


def test_mismatched_pairs_skip_the_same_prompt():
    """A pair's two completions sit side by side (rollouts, unshuffled pairs): each KL row skips to the
    next completion written for another prompt, never its own prompt's."""
    a, b = [1, 2], [3]
    prompts = [a, a, b, b]
    completions = [[10], [11], [12], [13]]
    _, kl, same = mismatched_pairs(prompts, completions)
    assert kl == [[12], [12], [10], [10]] and same == [False] * 4


def test_mismatched_pairs_one_prompt_borrows_from_donors():
    a = [1, 2]
    donors = [([3], [20]), (a, [21]), ([4], [22])]
    _, kl, same = mismatched_pairs([a, a], [[10], [11]], donors=donors)
    # row 0 scans the donors from 0, row 1 from 1 (skipping a's own completion 21)
    assert kl == [[20], [22]] and same == [False, False]
    # nothing to borrow: the matched shift, flagged
    _, kl, same = mismatched_pairs([a, a], [[10], [11]], donors=[(a, [21])])
    assert kl == [[11], [10]] and same == [True, True]


def test_mismatched_pairs_zero_weight_examples_lend_nothing():
    """A pair under the score threshold (weight 0) is dropped, as the authors do: no KL row borrows it."""
    prompts = [[1], [1], [2], [2], [3], [3]]
    completions = [[10], [11], [12], [13], [14], [15]]
    _, kl, _ = mismatched_pairs(prompts, completions, weights=[1, 1, 0, 0, 1, 1])
    assert kl[0] == [14] and kl[1] == [14] and kl[4] == [10] and kl[5] == [10]


def test_z0_leaves_out_zero_weight_rows():
    kl, mask = _kl_batch()
    weights = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    expected = _z0_by_hand(kl[weights > 0], mask[weights > 0])
    assert expected != pytest.approx(_z0_by_hand(kl, mask))  # the test can tell the difference
    assert kto_reference_point(kl, mask, weights=weights).item() == pytest.approx(expected)
    assert kto_reference_point(kl, mask, weights=torch.zeros(6)).item() == 0.0


def test_mismatched_pairs_edge_cases():
    assert mismatched_pairs([[1]], [[2]]) == ([[1]], [[2]], [True])
    assert mismatched_pairs([], []) == ([], [], [])
    with pytest.raises(ValueError):
        mismatched_pairs([[1], [2]], [[3]])
