"""TRL's own losses, every type, through the humanline TRL trainers (one CPU process, the tiny model): with
``NoTransform`` each DPO ``loss_type`` (and ``f_divergence_type``, ``ld_alpha``, ``use_weighting``) and each KTO loss
type gives TRL's own evaluation loss on the same model and batches within 1e-6 (relative, for losses over 1); with
clipping, DPO's losses equal an independent computation of TRL's formula on the clipped per-token log-ratios; every
GRPO loss type trains."""

import json
import math

import pytest
import torch

from helpers import REPO
from trl_common import grpo, settings

trl = pytest.importorskip("trl")

from distributed.trl_data import dpo_rows, load  # noqa: E402
from hl_core.humanline import ClipTransform, NoTransform  # noqa: E402
from hl_core.integrations.trl import HumanlineDPOTrainer, HumanlineKTOTrainer  # noqa: E402

ROWS = [json.loads(line) for line in (REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text().splitlines()][:8]
DPO_TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
             "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]


def perturbed(weights, seed=1, scale=0.05):
    """The tiny model with its weights moved a little: a reference the policy differs from."""
    model = load(weights)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


def close(a, b):
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def dpo_eval_loss(cls, weights, tmp_path, data, extra, **kw):
    from transformers import AutoTokenizer
    from trl import DPOConfig

    tok = AutoTokenizer.from_pretrained(weights)
    config = DPOConfig(**settings(tmp_path), beta=0.1, max_length=None, **extra)
    trainer = cls(load(weights), ref_model=perturbed(weights), args=config, train_dataset=data, eval_dataset=data,
                  processing_class=tok, **kw)
    return trainer.evaluate()["eval_loss"]


@pytest.mark.parametrize("extra", [{"loss_type": [t]} for t in DPO_TYPES] + [
    {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, {"f_divergence_type": "js_divergence"},
    {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.5}, {"ld_alpha": 0.5},
    {"use_weighting": True}], ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()))
def test_dpo_with_no_transform_gives_trls_loss(extra, weights, tmp_path):
    from datasets import Dataset
    from trl import DPOTrainer

    if extra.get("loss_type") in (["exo_pair"], ["robust"]):
        extra = {**extra, "label_smoothing": 0.1}
    data = Dataset.from_list([{"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:], "rejected": r["rejected"][-1:]}
                              for r in ROWS])
    theirs = dpo_eval_loss(DPOTrainer, weights, tmp_path / "trl", data, extra)
    ours = dpo_eval_loss(HumanlineDPOTrainer, weights, tmp_path / "hl", data, extra, transform=NoTransform(),
                         schedule=None)
    assert math.isfinite(theirs) and close(theirs, ours), (theirs, ours)


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_with_no_transform_gives_trls_loss(loss_type, weights, tmp_path):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(weights)
    data = Dataset.from_list([{"prompt": r[side][:-1], "completion": r[side][-1:], "label": side == "chosen"}
                              for r in ROWS for side in ("chosen", "rejected")])
    losses = []
    for cls, kw in ((KTOTrainer, {}), (HumanlineKTOTrainer, {"transform": NoTransform(), "schedule": None})):
        config = KTOConfig(**settings(tmp_path / cls.__name__, per_device_eval_batch_size=8), beta=0.1,
                           max_length=None, loss_type=loss_type)
        trainer = cls(load(weights), ref_model=perturbed(weights), args=config, train_dataset=data,
                      eval_dataset=data, processing_class=tok, **kw)
        losses.append(trainer.evaluate()["eval_loss"])
    assert math.isfinite(losses[0]) and close(*losses), losses


def clipped_sums(model, ref, rows, bounds):
    """Per row: the sum over the completion's tokens of clamp(lp_pol - lp_ref), and the completion's length."""
    out = []
    with torch.no_grad():
        for prompt, completion in rows:
            ids = torch.tensor([prompt + completion])
            start = len(prompt) - 1
            target = ids[0, len(prompt):]
            lp = [m(input_ids=ids).logits[0, start:-1].log_softmax(-1).gather(-1, target[:, None])[:, 0]
                  for m in (model, ref)]
            out.append((float((lp[0] - lp[1]).clamp(*bounds).sum()), len(completion)))
    return out


FORMULAS = {  # TRL's per-pair losses on the summed (clipped) log-ratios c, r and the completion lengths
    "hinge": lambda c, r, lc, lr, b: max(0.0, 1 - b * (c - r)),
    "ipo": lambda c, r, lc, lr, b: ((c / lc - r / lr) - 1 / (2 * b)) ** 2,
    "bco_pair": lambda c, r, lc, lr, b: -math.log(1 / (1 + math.exp(-b * c))) - math.log(1 / (1 + math.exp(b * r))),
    "apo_zero": lambda c, r, lc, lr, b: 1 - 1 / (1 + math.exp(-b * c)) + 1 / (1 + math.exp(-b * r)),
}


@pytest.mark.parametrize("loss_type", sorted(FORMULAS))
def test_dpo_with_clipping_is_trls_formula_on_the_clipped_log_ratios(loss_type, weights, tmp_path):
    from transformers import AutoTokenizer

    bounds = (-0.05, 0.05)
    tok = AutoTokenizer.from_pretrained(weights)
    data = dpo_rows(tok).select(range(8))
    ours = dpo_eval_loss(HumanlineDPOTrainer, weights, tmp_path, data, {"loss_type": [loss_type]},
                         transform=ClipTransform(*bounds), schedule=None)
    chosen = clipped_sums(load(weights), perturbed(weights), [(r["prompt_ids"], r["chosen_ids"]) for r in data], bounds)
    rejected = clipped_sums(load(weights), perturbed(weights), [(r["prompt_ids"], r["rejected_ids"]) for r in data],
                            bounds)
    per_pair = [FORMULAS[loss_type](c, r, lc, lr, 0.1) for (c, lc), (r, lr) in zip(chosen, rejected)]
    expected = (sum(per_pair[:4]) / 4 + sum(per_pair[4:]) / 4) / 2  # two evaluation batches of 4
    assert any(abs(c) >= 0.05 for c, _ in chosen)  # the clip binds on whole sums too
    assert abs(ours - expected) <= 1e-5 * max(1.0, abs(expected)), (ours, expected)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo"])
def test_every_grpo_loss_type_trains(loss_type, weights, tmp_path):
    trainer = grpo(weights, tmp_path, args={"max_steps": 2, "loss_type": loss_type, "max_completion_length": 64})
    trainer.train()
    assert all(math.isfinite(row["loss"]) for row in trainer.humanline_history)
