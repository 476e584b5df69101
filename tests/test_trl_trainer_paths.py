"""The humanline TRL trainers on the paths a TRL user takes (one CPU process, the tiny model, in this process):
checkpoints with ``save_steps`` (the metrics go to JSON as floats), an epoch whose last batch is smaller,
``compute_metrics`` (TRL's extra forward for the logits), GRPO's entropy
bonus and a mixture-of-experts router's auxiliary loss (applied, as TRL applies them)."""

import json
import math

import pytest
import torch

from helpers import REPO
from trl_common import checksum, conversational, dpo, grpo, kto, settings

trl = pytest.importorskip("trl")

from distributed.trl_data import grpo_rows, load  # noqa: E402
from hl_core.humanline import NoTransform, SyncSchedule  # noqa: E402


@pytest.mark.parametrize("build", [dpo, kto,
                                   grpo])
def test_checkpoints_are_written_and_the_logged_metrics_are_floats(build, weights, tmp_path):
    trainer = build(weights, tmp_path, args={"save_strategy": "steps", "save_steps": 1, "max_steps": 2})
    trainer.train()
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [row for row in state["log_history"] if "humanline/clipped_frac" in row]
    assert len(logged) == 2 and all(isinstance(v, (int, float)) for row in logged for v in row.values())


def test_dpo_trains_through_an_epochs_last_smaller_batch(weights, tmp_path):
    trainer = dpo(weights, tmp_path, rows=5, args={"num_train_epochs": 1})  # batches of 4 then 1
    trainer.train()
    assert [row["update"] for row in trainer.humanline_history] == [0, 1]
    assert all(math.isfinite(row["loss"]) for row in trainer.humanline_history)


@pytest.mark.parametrize("build", [dpo, kto])
def test_compute_metrics_gets_the_logits_as_with_trl(build, weights, tmp_path):
    seen = []

    def compute_metrics(prediction):
        seen.append(prediction.predictions.shape)
        return {"seen": 1.0}

    result = build(weights, tmp_path, compute_metrics=compute_metrics).evaluate()
    assert result["eval_seen"] == 1.0 and math.isfinite(result["eval_loss"])
    assert seen and seen[0][-1] == 448  # the vocabulary: TRL's extra forward gave the logits


def first_loss(weights, tmp_path, transform=None, **args):
    keywords = {"transform": transform} if transform is not None else {}
    trainer = grpo(weights, tmp_path, args={"max_steps": 1, **args}, **keywords)
    trainer.train()
    return trainer.humanline_history[0]["loss"]


def test_grpo_applies_the_entropy_bonus_as_trl_does(weights, tmp_path):
    """At the first update the reference equals the policy: the loss with ``entropy_coef`` is the loss without it
    minus ``coef`` times the mean per-token entropy of the completions (computed here from the logits)."""
    from transformers import AutoTokenizer

    plain = first_loss(weights, tmp_path / "a")
    bonus = first_loss(weights, tmp_path / "b", entropy_coef=0.3)
    tok = AutoTokenizer.from_pretrained(weights)
    rows = grpo_rows(tok).select(range(8))
    model, total, count = load(weights), 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            logits = model(input_ids=ids).logits[0, len(row["prompt_ids"]) - 1:-1]
            p = logits.log_softmax(-1)
            total, count = total + float(-(p.exp() * p).sum()), count + len(row["completion_ids"])
    assert abs((plain - bonus) - 0.3 * total / count) < 1e-5, (plain, bonus, total / count)


def test_grpo_with_a_mixture_of_experts_adds_the_router_aux_loss(tmp_path):
    """A tiny Qwen3-MoE: the first update's loss with ``router_aux_loss_coef`` exceeds the one without it by the
    coefficient times the router's load-balancing loss (the model's own, on the same inputs)."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=448, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, pad_token_id=0, output_router_logits=False)
    torch.manual_seed(0)
    path = tmp_path / "moe"
    Qwen3MoeForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "tests" / "fixtures" / "tiny" / "model").save_pretrained(path)
    without = first_loss(path, tmp_path / "a", transform=NoTransform(), router_aux_loss_coef=0.0)
    with_aux = first_loss(path, tmp_path / "b", transform=NoTransform(), router_aux_loss_coef=0.5)
    tok = AutoTokenizer.from_pretrained(path)
    rows = grpo_rows(tok).select(range(8))
    model = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)
    width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        seq = row["prompt_ids"] + row["completion_ids"]
        ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
    with torch.no_grad():
        aux = float(model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss)
    assert aux > 0 and abs((with_aux - without) - 0.5 * aux) < 1e-3 * aux, (with_aux, without, aux)


def test_the_callback_syncs_a_stock_trl_trainer_before_the_step(weights, tmp_path):
    """TRL's own ``DPOTrainer`` with ``HumanlineSyncCallback`` added (k = 2, 4 updates): synced at updates 0 and 2,
    and at the end the reference holds the policy's weights from the start of update 2 (pre-update), not the end."""
    from transformers import AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from hl_core.integrations.trl import HumanlineSyncCallback

    class Begin(TrainerCallback):
        sums = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.sums.append(checksum(trainer.model))

    tok = AutoTokenizer.from_pretrained(weights)
    trainer = DPOTrainer(load(weights), ref_model=load(weights), processing_class=tok,
                         args=DPOConfig(**settings(tmp_path, max_steps=4), beta=0.1, max_length=None),
                         train_dataset=conversational("dpo"))
    sync = HumanlineSyncCallback(trainer, SyncSchedule(every=2))
    begin = Begin()
    trainer.add_callback(sync)
    trainer.add_callback(begin)
    trainer.train()
    assert [row["synced"] for row in sync.history] == [True, False, True, False]
    assert abs(checksum(trainer.ref_model) - begin.sums[2]) < 1e-9 and abs(begin.sums[3] - begin.sums[2]) > 1e-6
