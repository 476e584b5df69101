"""Options that let a recipe match the authors' runs exactly (docs/authors-settings.md): the GRPO advantage's
std and epsilon, the `dapo` token normaliser over all ranks, the MATH reward's tag-count term and newline
format rule, and the phase of reference syncing. Each against hand-computed values, gradients included."""

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import REPO, TINY_HUMANLINE, free_port, read_jsonl, run_recipe
from hl_core.humanline import SyncSchedule
from hl_core.objectives import group_advantages, grpo_loss
from hl_core.rollout.rewards import MathReward, format_ok, tag_count

# ------------------------------------------------------------------------------ advantages


def test_sample_std_advantages_match_numpy_ddof1():
    scores = np.array([1.0, 2.0, 4.0, 0.5, 0.25, 7.0])
    groups = np.array([3, 3, 3, 8, 8, 11])
    got = group_advantages(torch.tensor(scores), torch.tensor(groups), eps=1e-4, std="sample").numpy()
    expected = np.zeros(6)
    for g in (3, 8):
        idx = groups == g
        expected[idx] = (scores[idx] - scores[idx].mean()) / (scores[idx].std(ddof=1) + 1e-4)
    np.testing.assert_allclose(got, expected, rtol=1e-12)
    assert got[5] == 0.0  # a group of one
    # by hand: [1, 2, 4] has mean 7/3 and sample variance 7/3
    assert got[0] == pytest.approx((1 - 7 / 3) / (np.sqrt(7 / 3) + 1e-4), rel=1e-12)
    with pytest.raises(ValueError, match="std"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), std="unbiased")


def test_halos_epsilon_on_a_small_armorm_gap():
    """A pair of raw ArmoRM scores 0.12 / 0.10 (population std 0.01): HALOs' eps 1e-2 gives +-0.5, eps 1e-4
    gives +-0.990, so the gradient of each token is twice as large with 1e-4."""
    pair = torch.tensor([0.12, 0.10], dtype=torch.float64)
    halos = group_advantages(pair, torch.tensor([0, 0]), eps=1e-2)
    ours = group_advantages(pair, torch.tensor([0, 0]), eps=1e-4)
    np.testing.assert_allclose(halos.numpy(), [0.5, -0.5], rtol=1e-9)
    np.testing.assert_allclose(ours.numpy(), [0.01 / 0.0101, -0.01 / 0.0101], rtol=1e-9)
    # at ratio 1 (log-ratio 0) and no PPO clip, d loss / d log-ratio of each token = -A / (tokens)
    lr = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 3, dtype=torch.float64)
    (grad,) = torch.autograd.grad(grpo_loss(lr, mask, halos, 0.2, 0.2)[0], [lr])
    np.testing.assert_allclose(grad.numpy(), [[-0.5 / 6] * 3, [0.5 / 6] * 3], rtol=1e-9)


# ------------------------------------------------------------------------------ dapo over ranks


def _rank_batch(rank):
    """Rank ``rank``'s micro-batch: one prompt group of three sequences, log-ratios, mask and scores."""
    g = torch.Generator().manual_seed(rank)
    lengths = [[5, 2, 3], [1, 0, 4]][rank]  # rank 0: 10 completion tokens, rank 1: 5 (one empty sequence)
    mask = (torch.arange(6)[None, :] < torch.tensor(lengths)[:, None]).to(torch.float64)
    lr = (torch.randn(3, 6, generator=g, dtype=torch.float64) * 0.3) * mask
    scores = torch.tensor([[0.9, 0.1, 0.4], [1.0, 0.0, 0.2]][rank], dtype=torch.float64)
    return lr, mask, scores


def _dapo_worker(rank, world_size, port, out_dir):
    from types import SimpleNamespace

    from hl_core.objectives.grpo import grpo_batch_loss

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        lr, mask, scores = _rank_batch(rank)
        lr.requires_grad_(True)
        cfg = SimpleNamespace(advantage_eps=1e-4, advantage_std="population", eps_low=0.2, eps_high=0.2, beta_kl=0.0,
                              aggregation="dapo")
        inputs = SimpleNamespace(batch={"scores": scores, "group_ids": torch.zeros(3, dtype=torch.long)},
                                 policy_logps=lr, ref_logps=torch.zeros_like(lr), mask=mask, log_ratios=lr,
                                 humanline_active=True, has_reference=False, update_normalised=False)
        loss, _ = grpo_batch_loss(cfg, inputs)
        (grad,) = torch.autograd.grad(loss, [lr])
        torch.save({"loss": loss.detach(), "grad": grad}, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_dapo_over_two_ranks_is_the_token_mean_over_all_ranks(tmp_path):
    """Each rank divides its token sum by the mean tokens per rank (7.5); the data-parallel mean of the two
    ranks' losses and gradients is then the token mean over all 15 tokens of both ranks."""
    mp.spawn(_dapo_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    batches = [_rank_batch(r) for r in (0, 1)]
    advs = [group_advantages(b[2], torch.zeros(3)) for b in batches]
    lr_all = torch.cat([b[0] for b in batches]).requires_grad_(True)
    mask_all = torch.cat([b[1] for b in batches])
    loss_all, _ = grpo_loss(lr_all, mask_all, torch.cat(advs), 0.2, 0.2, aggregation="token")
    (grad_all,) = torch.autograd.grad(loss_all, [lr_all])
    assert (got[0]["loss"] + got[1]["loss"]).item() / 2 == pytest.approx(loss_all.item(), rel=1e-12)
    for r in (0, 1):
        np.testing.assert_allclose((got[r]["grad"] / 2).numpy(), grad_all[3 * r: 3 * r + 3].numpy(), rtol=1e-12)
    # by hand, rank 0: its token sum / 7.5, not / its own 10 tokens
    lr0, mask0, _ = batches[0]
    rho, a = lr0.exp().numpy(), advs[0].numpy()[:, None]
    per_token = -np.minimum(rho * a, np.clip(rho, 0.8, 1.2) * a) * mask0.numpy()
    assert got[0]["loss"].item() == pytest.approx(per_token.sum() / 7.5, rel=1e-12)
    assert abs(per_token.sum() / 10 - per_token.sum() / 7.5) > 1e-3


# ------------------------------------------------------------------------------ MATH reward terms


@pytest.mark.parametrize("text, expected", [
    ("<think>\nwork\n</think>\n<answer>\n4\n</answer>", 1.0),
    ("<think>work</think><answer>4</answer>", 0.0),
    ("<think>\nwork\n</think>\n<answer>4</answer>", 0.5),
    ("<think>\na\n</think>\n<think>\nb\n</think>\n<answer>\n4\n</answer>", 0.5),  # two thinks: both lose
    ("plain 4", 0.0),
])
def test_tag_count_by_hand(text, expected):
    assert tag_count(text) == expected


def test_newline_format_rule_and_the_math_reward_sum():
    tidy = "<think>\nadd\n</think>\n<answer>\n4\n</answer>"
    squeezed = "<think>add</think> <answer>4</answer>"
    assert format_ok(tidy, "newlines") and format_ok(tidy) and format_ok(squeezed)
    assert not format_ok(squeezed, "newlines")
    assert format_ok(tidy + "\ntrailing line", "newlines") and not format_ok(tidy + "\ntrailing line")
    from types import SimpleNamespace

    cfg = SimpleNamespace(accuracy_weight=8.0, format_weight=1.0, format_style="newlines", tag_count_weight=1.0)
    scores = MathReward(cfg)([None] * 3, [tidy, squeezed, "<think>\nx\n</think>\n<answer>5</answer>"], ["4"] * 3)
    assert scores == [8.0 + 1.0 + 1.0, 8.0 + 0.0 + 0.0, 0.0 + 0.0 + 0.5]


# ------------------------------------------------------------------------------ sync phase


def test_sync_offset_by_hand():
    assert [n for n in range(40) if SyncSchedule(16).due(n)] == [0, 16, 32]
    assert [n for n in range(40) if SyncSchedule(16, 15).due(n)] == [15, 31]  # after updates 16, 32 counted from 1


def test_sync_offset_outside_the_period_is_refused(capsys, monkeypatch):
    from launchers.run import main

    monkeypatch.chdir(REPO)
    for overrides in (["humanline.sync_every=4", "humanline.sync_offset=4"],
                      ["humanline.sync_every=null", "humanline.sync_offset=1"]):
        assert main([str(TINY_HUMANLINE), *overrides, "--validate"]) == 2
        err = capsys.readouterr().err
        assert "humanline.sync_offset" in err and "Fix" in err and err.strip().count("\n") == 0


def test_sync_offset_in_a_real_run(tmp_path):
    run_recipe(TINY_HUMANLINE, [f"output_dir={tmp_path}", "humanline.sync_every=2", "humanline.sync_offset=1",
                                "train.max_steps=4", "eval.every=null", "checkpoint.save_every=null",
                                "checkpoint.save_final=false"])
    assert [r["synced"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [False, True, False, True]


# ------------------------------------------------------------------------------ online GRPO on best/worst pairs


def test_best_worst_groups_by_hand():
    from hl_core.rollout import _best_worst_group_examples

    out = []
    kept = _best_worst_group_examples(out, [7], [[1], [2], [3], [4]], [0.3, 0.9, 0.1, 0.5], 0.01)
    kept += _best_worst_group_examples(out, [8], [[5], [6]], [0.5, 0.505], 0.01)
    assert kept == [1.0, 0.0]
    assert out[0] == {"input_ids": [[7, 2], [7, 3]], "completion_mask": [[0, 1], [0, 1]], "scores": [0.9, 0.1],
                      "weight": 1.0}
    assert out[1]["weight"] == 0.0 and out[1]["scores"] == [0.505, 0.5]


def _grouped_inputs(weights):
    from hl_core.data.grouped import collate_groups
    from hl_core.objectives import ObjectiveInputs

    feats = [{"input_ids": [[1, 2, 3], [1, 4]], "completion_mask": [[0, 1, 1], [0, 1]], "scores": [1.0, 0.0]},
             {"input_ids": [[5, 6], [5, 7, 8]], "completion_mask": [[0, 1], [0, 1, 1]], "scores": [0.2, 0.9]}]
    batch = collate_groups(feats, 0)
    batch["weights"] = torch.tensor(weights)
    g = torch.Generator().manual_seed(3)
    mask = batch["completion_mask"].to(torch.float64)
    lr = (torch.randn(4, 3, generator=g, dtype=torch.float64) * 0.1 * mask).requires_grad_(True)
    inputs = ObjectiveInputs(batch=batch, policy_logps=lr, ref_logps=torch.zeros_like(lr), mask=mask, log_ratios=lr,
                             transform=None, token_logps=None, humanline_active=True, has_reference=False)
    return inputs, lr


@pytest.mark.parametrize("aggregation", ["token", "dapo"])
def test_zero_weight_groups_are_dropped_from_the_grpo_loss(aggregation):
    from types import SimpleNamespace

    from hl_core.objectives.grpo import grpo_batch_loss

    cfg = SimpleNamespace(advantage_eps=1e-2, advantage_std="population", eps_low=0.2, eps_high=0.2, beta_kl=0.0,
                          aggregation=aggregation)
    inputs, lr = _grouped_inputs([1.0, 0.0])
    loss, metrics = grpo_batch_loss(cfg, inputs)
    (grad,) = torch.autograd.grad(loss, [lr])
    # by hand: group 0 alone, advantages +-0.5 / (0.5 + 1e-2) (scores are float32), its 3 completion tokens
    a = float(np.float32(0.5 / 0.51))
    rho = lr.detach()[:2].exp().numpy()
    adv = np.array([[a], [-a]])
    per_token = -np.minimum(rho * adv, np.clip(rho, 0.8, 1.2) * adv) * inputs.mask[:2].numpy()
    assert loss.item() == pytest.approx(per_token.sum() / 3, rel=1e-12)
    expected = np.where(inputs.mask[:2].numpy() > 0, -adv * rho / 3, 0.0)
    np.testing.assert_allclose(grad[:2].numpy(), expected, rtol=1e-10, atol=1e-15)
    assert torch.all(grad[2:] == 0) and metrics["advantages/max"] == pytest.approx(a)
    none_loss, none_metrics = grpo_batch_loss(cfg, _grouped_inputs([0.0, 0.0])[0])
    assert none_loss.item() == 0.0 and none_loss.requires_grad and none_metrics == {}


def test_best_worst_groups_in_a_real_run(tmp_path, capsys, monkeypatch):
    from launchers.run import main

    tiny_rm = REPO / "recipes" / "tiny" / "online_dpo_rm.yaml"
    run_recipe(tiny_rm, [f"output_dir={tmp_path}", "objective={name: grpo}", "rollout.group=best_worst",
                         "train.max_steps=2", "eval.every=null", "checkpoint.save_final=false"])
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(0.0 <= r["pairs_kept_frac"] <= 1.0 for r in rows)
    assert any(r["pairs_kept_frac"] > 0 and r["advantages/max"] > 0.9 for r in rows)  # kept pairs: A = +-1
    monkeypatch.chdir(REPO)
    assert main([str(tiny_rm), "rollout.group=best_worst", "--validate"]) == 2
    assert "rollout.group" in capsys.readouterr().err
