"""The DPO family (`objective.loss_type`): each loss and its gradient against hand-computed values, against TRL's own
code on identical inputs (skipped without TRL), the reference-free SimPO's checks and reference mode, and every
type through the real trainer."""

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO, run_worker
from hl_core.config import load_recipe, reference_mode
from hl_core.config.checks import check_reference_free
from hl_core.errors import RecipeError
from hl_core.objectives.dpo import dpo_loss
from hl_core.objectives.dpo_losses import LOSS_TYPES, PAIR_LOSSES
from launchers.run import main

LOSS_TYPES_RECIPE = REPO / "recipes" / "tiny" / "dpo_loss_types.yaml"
SETTINGS = {"beta": 0.3, "label_smoothing": 0.2, "simpo_gamma": 0.7}
SIMPO_OFF = ["objective.loss_type=simpo", "humanline.transform=none", "humanline.sync_every=null"]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _hand(loss_type, c, r, beta, eps, gamma):
    """Per pair, from the pair's two scores: (loss, d loss / d chosen score) in plain floats."""
    d = c - r
    if loss_type == "sigmoid":
        return math.log1p(math.exp(-beta * d)), -beta * _sigmoid(-beta * d)
    if loss_type == "hinge":
        return max(0.0, 1 - beta * d), -beta * float(1 - beta * d > 0)
    if loss_type == "ipo":
        return (d - 1 / (2 * beta)) ** 2, 2 * (d - 1 / (2 * beta))
    if loss_type == "robust":
        z = beta * d
        loss = ((1 - eps) * math.log1p(math.exp(-z)) - eps * math.log1p(math.exp(z))) / (1 - 2 * eps)
        return loss, beta * (-(1 - eps) * _sigmoid(-z) - eps * _sigmoid(z)) / (1 - 2 * eps)
    z = beta * d - gamma  # simpo
    return math.log1p(math.exp(-z)), -beta * _sigmoid(-z)


def _inputs(seed, B=4, T=7):
    gen = torch.Generator().manual_seed(seed)
    chosen = (torch.randn(B, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    rejected = (torch.randn(B, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    masks = [(torch.rand(B, T, generator=gen) > 0.3).double() for _ in range(2)]
    for mask in masks:
        mask[:, 0] = 0.0  # a prompt token
        mask[:, 1] = 1.0  # every completion has a token
    return chosen, masks[0], rejected, masks[1]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_matches_hand_values_and_gradients(loss_type):
    chosen, cm, rejected, rm = _inputs(0)
    beta, eps, gamma = SETTINGS["beta"], SETTINGS["label_smoothing"], SETTINGS["simpo_gamma"]
    loss, metrics = dpo_loss(chosen, cm, rejected, rm, beta=beta, loss_type=loss_type,
                             label_smoothing=eps if loss_type == "robust" else 0.0, simpo_gamma=gamma)
    g_c, g_r = torch.autograd.grad(loss, (chosen, rejected))
    mean = PAIR_LOSSES[loss_type].length_normalised  # ipo, simpo: per-token means, else sums
    B = chosen.shape[0]
    expected = 0.0
    for b in range(B):
        n_c, n_r = cm[b].sum().item(), rm[b].sum().item()
        c = sum(chosen[b, t].item() for t in range(7) if cm[b, t]) / (n_c if mean else 1)
        r = sum(rejected[b, t].item() for t in range(7) if rm[b, t]) / (n_r if mean else 1)
        pair, slope = _hand(loss_type, c, r, beta, eps if loss_type == "robust" else 0.0, gamma)
        expected += pair / B
        for t in range(7):  # d loss / d token = slope * (1 / tokens for a mean) / B, the opposite for rejected
            assert g_c[b, t].item() == pytest.approx(slope * cm[b, t].item() / (n_c if mean else 1) / B, abs=1e-12)
            assert g_r[b, t].item() == pytest.approx(-slope * rm[b, t].item() / (n_r if mean else 1) / B, abs=1e-12)
        if loss_type == "hinge":
            assert 1 - beta * (c - r) != 0.0  # away from the kink, where the slope is a choice
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert g_c.abs().sum() > 0 and g_r.abs().sum() > 0
    # implicit rewards: beta x the summed log-ratio (SimPO: beta x the mean log-prob)
    per_token = loss_type == "simpo"
    rewards = beta * ((chosen * cm).sum(-1) / (cm.sum(-1) if per_token else 1))
    assert metrics["rewards/chosen"] == pytest.approx(rewards.mean().item(), abs=1e-12)


def test_robust_without_smoothing_is_dpo_and_the_types_differ():
    chosen, cm, rejected, rm = _inputs(1)
    values = {t: dpo_loss(chosen, cm, rejected, rm, beta=0.3, loss_type=t)[0].item() for t in LOSS_TYPES}
    assert values["robust"] == pytest.approx(values["sigmoid"], abs=1e-12)
    assert len({round(v, 9) for k, v in values.items() if k != "robust"}) == len(LOSS_TYPES) - 1


def _trl_dpo(loss_type, chosen, cm, rejected, rm, ref_c, ref_r, beta, eps):
    """TRL's DPOTrainer loss code on these per-token log-probs: its `_compute_loss`, the model a module that returns
    them as its fused LM head would (0 off the completion), reference log-probs precomputed (TRL's sums)."""
    from trl import DPOTrainer

    policy = torch.cat([chosen * cm, rejected * rm])
    mask = torch.cat([cm, rm]).long()

    class PerTokenLogps(torch.nn.Module):
        is_gradient_checkpointing = False

        def forward(self, **kwargs):
            zeros = torch.zeros_like(policy[:, 1:])
            return SimpleNamespace(log_probs=policy[:, 1:], entropy=zeros, mean_logits=zeros, is_top1=zeros.bool(),
                                   aux_loss=None)

    model = PerTokenLogps().train()
    identity = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = SimpleNamespace(
        model=model, ref_model=None, accelerator=identity, args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        f_alpha_divergence_coef=1.0, loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=eps,
        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)), _total_train_tokens=0, _tp_size=1,
    )
    inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": torch.ones_like(mask), "completion_mask": mask,
              "ref_chosen_logps": (ref_c * cm).sum(-1), "ref_rejected_logps": (ref_r * rm).sum(-1)}
    return DPOTrainer._compute_loss(trainer, model, inputs, return_outputs=False)


def _trl_simpo(logits, labels, beta, gamma):
    """TRL's SimPO (`CPOTrainer(loss_type="simpo")`, no NLL term): its mean log-probs and its `cpo_loss`."""
    from trl.experimental.cpo import CPOTrainer

    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    half = logits.shape[0] // 2
    trainer = SimpleNamespace(alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
                              accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, _, _ = CPOTrainer.cpo_loss(trainer, logps[:half], logps[half:])
    return losses.mean()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_against_trl_on_identical_inputs(loss_type):
    """The same per-token log-probs into TRL's code and ours: loss and gradients agree (float64)."""
    pytest.importorskip("trl", reason="TRL is an optional reference here: `pip install trl` to run the comparison")
    beta, eps, gamma = SETTINGS["beta"], SETTINGS["label_smoothing"] if loss_type == "robust" else 0.0, 0.7
    if loss_type == "simpo":  # reference-free: TRL's SimPO starts from logits; ours from their token log-probs
        gen = torch.Generator().manual_seed(2)
        logits = torch.randn(6, 9, 11, generator=gen, dtype=torch.float64, requires_grad=True)
        labels = torch.randint(0, 11, (6, 9), generator=gen)
        labels[:, :3] = -100  # prompt tokens
        labels[0, 7:] = -100  # padding
        theirs = _trl_simpo(logits, labels, beta, gamma)
        (g_theirs,) = torch.autograd.grad(theirs, logits)
        mask = (labels[:, 1:] != -100).double()
        token_logps = torch.log_softmax(logits[:, :-1], -1).gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1))[..., 0]
        ours, _ = dpo_loss(token_logps[:3], mask[:3], token_logps[3:], mask[3:], beta=beta, loss_type="simpo",
                           simpo_gamma=gamma)
        (g_ours,) = torch.autograd.grad(ours, logits)
        diffs = (abs(ours.item() - theirs.item()), (g_ours - g_theirs).abs().max().item())
    else:
        chosen, cm, rejected, rm = _inputs(3)
        gen = torch.Generator().manual_seed(4)
        ref_c, ref_r = (torch.randn(4, 7, generator=gen, dtype=torch.float64) for _ in range(2))
        theirs = _trl_dpo(loss_type, chosen, cm, rejected, rm, ref_c, ref_r, beta, eps)
        g_theirs = torch.autograd.grad(theirs, (chosen, rejected))
        ours, _ = dpo_loss(chosen - ref_c, cm, rejected - ref_r, rm, beta=beta, loss_type=loss_type,
                           label_smoothing=eps)
        g_ours = torch.autograd.grad(ours, (chosen, rejected))
        diffs = (abs(ours.item() - theirs.item()), max((a - b).abs().max().item() for a, b in zip(g_ours, g_theirs)))
    print(f"TRL vs hl_core, loss_type {loss_type}: max |loss diff| {diffs[0]:.3g}, max |grad diff| {diffs[1]:.3g}")
    assert theirs.item() != 0.0 and diffs[0] < 1e-12 and diffs[1] < 1e-12, diffs


def test_simpo_is_reference_free_and_refuses_humanline():
    simpo = load_recipe(LOSS_TYPES_RECIPE, SIMPO_OFF)
    assert reference_mode(simpo)[0] == "none"
    for extra, keys in ((["humanline.transform=clip"], ["`humanline.transform: clip`"]),
                        (["humanline.sync_every=2"], ["`humanline.sync_every: 2`"]),
                        (["humanline.transform=sample", "humanline.sync_every=1"],
                         ["`humanline.transform: sample`", "`humanline.sync_every: 1`"])):
        with pytest.raises(RecipeError) as info:
            check_reference_free(load_recipe(LOSS_TYPES_RECIPE, SIMPO_OFF + extra))
        assert all(k in str(info.value) for k in keys + ["`objective.loss_type: simpo`", "Fix"]), str(info.value)
    assert main([str(LOSS_TYPES_RECIPE), "objective.loss_type=simpo", "--validate"]) == 2  # one paragraph, exit 2
    for loss_type in ("sigmoid", "ipo", "hinge", "robust"):  # a reference, read through humanline
        assert reference_mode(load_recipe(LOSS_TYPES_RECIPE, [f"objective.loss_type={loss_type}"]))[0] != "none"


@pytest.mark.parametrize("overrides, needle", [
    (["objective.loss_type=dpo2"], "`objective.loss_type` is invalid"),
    (["objective.label_smoothing=0.1"], "read by `loss_type: robust` only"),
    (["objective.loss_type=robust", "objective.label_smoothing=0.5"], "`objective.label_smoothing` is invalid"),
    (["objective.simpo_gamma=1.0"], "read by `loss_type: simpo` only"),
    (SIMPO_OFF + ["objective.simpo_gamma=-1"], "`objective.simpo_gamma` is invalid"),
])
def test_bad_loss_keys_name_the_key(overrides, needle):
    with pytest.raises(RecipeError) as info:
        load_recipe(LOSS_TYPES_RECIPE, overrides)
    assert needle in str(info.value) and "Fix" in str(info.value)


def test_every_loss_type_through_the_real_trainer(tmp_path):
    """One pair per update (`micro_batch_size: 1`), humanline clipping and syncing every update for the reference-based
    types: at update 0 policy == reference, so the losses are their values at d = 0; later updates are checked against
    the logged implicit reward margin m = beta (c - r) of the one pair (IPO's loss reads per-token means instead)."""
    common = "train.max_steps=3,train.micro_batch_size=1,train.warmup_steps=0"
    runs = {
        "sigmoid": "objective.loss_type=sigmoid,objective.beta=0.5",
        "ipo": "objective.loss_type=ipo",  # the recipe's beta 0.5: target margin 1
        "hinge": "objective.loss_type=hinge,objective.beta=0.5",
        "robust": "objective.loss_type=robust,objective.beta=0.5,objective.label_smoothing=0.2",
        "simpo": ",".join(SIMPO_OFF) + ",objective.beta=2.0,objective.simpo_gamma=1.0",
    }
    report = tmp_path / "report.json"
    run_worker(REPO / "tests/distributed/trainer_runs.py",
               [report, *(f"{name}|{LOSS_TYPES_RECIPE}|{common},{o}" for name, o in runs.items())])
    got = json.loads(report.read_text())
    at_zero = {"sigmoid": math.log(2), "ipo": 1.0, "hinge": 1.0, "robust": math.log(2)}
    for name, loss0 in at_zero.items():
        rows = got[name]["rows"]
        assert got[name]["reference_mode"] == "lookahead" and rows[0]["rewards/margin"] == 0.0
        assert rows[0]["loss"] == pytest.approx(loss0, abs=1e-6), name
        assert len({round(r["loss"], 6) for r in rows}) == 3, (name, rows)  # the later updates move
    for name in ("sigmoid", "hinge", "robust"):
        for row in got[name]["rows"]:
            pair, _ = _hand(name, row["rewards/margin"] / 0.5, 0.0, 0.5, 0.2 if name == "robust" else 0.0, 0.0)
            assert row["loss"] == pytest.approx(pair, abs=1e-5), (name, row)
    simpo = got["simpo"]
    assert simpo["reference_mode"] == "none" and not simpo["has_reference"] and not simpo["reference_model"]
    for row in simpo["rows"]:  # m = beta x (mean log-prob of chosen - rejected) = beta x policy/margin
        assert row["rewards/margin"] == pytest.approx(2.0 * row["policy/margin"], abs=1e-5)
        assert row["loss"] == pytest.approx(math.log1p(math.exp(1.0 - row["rewards/margin"])), abs=1e-5)
