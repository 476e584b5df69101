"""A LoRA policy on the humanline TRL trainers (``hl_core.integrations.trl.lora``): the reference is a second
adapter, ``ref``, synced from the policy's adapter (``pair_lora_adapters``), not a second model.

* DPO, KTO and GRPO with a ``PeftModel`` give the pack's own ``model.lora`` path's per-update losses
  (``launchers/run.py``, the same tiny model, data and adapter initialisation, k = 2, bounds that bind) within 1e-5;
* with the sync after the optimizer step instead, the DPO losses differ (the comparison can fail);
* ``peft_config=`` gets the ``ref`` adapter too, the sync copies adapter tensors only, and a reference forward
  leaves ``requires_grad`` as it was;
* a prompt-learning policy is refused in one paragraph, after TRL's own checks; ``HumanlineSyncCallback`` on a
  stock trainer with PEFT syncs TRL's ``ref`` adapter, or refuses where TRL's reference is the base model.
"""

import shutil

import pytest
import torch

from helpers import REPO
from trl_common import check_equal, conversational, max_diff, pack_losses, settings, trl_run

pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from distributed.trl_data import dpo_rows, load  # noqa: E402
from hl_core.errors import UserError  # noqa: E402
from hl_core.humanline import SyncSchedule  # noqa: E402
from hl_core.integrations.trl import HumanlineSyncCallback, HumanlineTrlSettingError  # noqa: E402
from hl_core.integrations.trl.lora import REFERENCE_ADAPTER  # noqa: E402

TINY = REPO / "recipes" / "tiny"
LORA = ("model.lora.r=8", "model.lora.alpha=16", "model.lora.dropout=0.0",
        "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]")
LR = "0.01"  # the LoRA recipe's: the adapter moves enough for the clip to bind


@pytest.mark.parametrize("kind, recipe", [("dpo", "humanline_dpo_lora.yaml"),
                                          ("kto", "humanline_kto.yaml"),
                                          ("grpo", "humanline_grpo.yaml")])
def test_lora_through_trl_equals_the_packs_lora_path(kind, recipe, weights, tmp_path):
    pack = pack_losses(TINY / recipe, weights, tmp_path, *LORA, f"train.lr={LR}")
    reports = trl_run(kind, weights, tmp_path, "--lora-seed", "0", "--lr", LR)
    check_equal(reports, pack, f"{kind}, LoRA, one process")
    if kind == "dpo":
        late = trl_run("dpo", weights, tmp_path, "--lora-seed", "0", "--lr", LR, "--late", name="late")
        assert max_diff(late[0]["history"], pack) > 1e-4, "a sync after the optimizer step must not match"


def trainer_with_peft_config(weights, tmp_path, config, **extra):
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from hl_core.integrations.trl import HumanlineDPOTrainer

    tok = AutoTokenizer.from_pretrained(weights)
    args = DPOConfig(**settings(tmp_path, max_steps=2), beta=0.1, max_length=None)
    return HumanlineDPOTrainer(load(weights), args=args, train_dataset=dpo_rows(tok).select(range(8)),
                               processing_class=tok, peft_config=config, **extra)


def test_peft_config_gets_a_ref_adapter_synced_from_the_policys(weights, tmp_path):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = trainer_with_peft_config(weights, tmp_path, config, schedule=SyncSchedule(every=1))
    model = trainer.model
    assert trainer.ref_model is None and REFERENCE_ADAPTER in model.peft_config
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
    reference = {n: p for n, p in model.named_parameters() if f".{REFERENCE_ADAPTER}." in n}
    assert reference and not any(p.requires_grad for p in reference.values())
    trainer.train()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the forwards changed nothing
    records = trainer.humanline_sync.records
    assert [r.synced for r in records] == [True, True]
    assert records[-1].bytes == sum(p.numel() * p.element_size() for p in reference.values())  # adapters only
    policy = {n.replace(".default.", f".{REFERENCE_ADAPTER}."): p for n, p in model.named_parameters()
              if ".default." in n}
    moved = max(float((policy[n] - p).detach().abs().max()) for n, p in reference.items())
    assert moved > 0, "the last update moved the policy's adapter past the reference synced before it"
    assert all(torch.isfinite(p).all() for p in reference.values())


def test_a_prompt_learning_policy_is_refused_in_one_paragraph(weights, tmp_path):
    config = peft.PromptTuningConfig(task_type=peft.TaskType.CAUSAL_LM, num_virtual_tokens=4)
    with pytest.raises(HumanlineTrlSettingError) as info:
        trainer_with_peft_config(weights, tmp_path, config)
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message and "LoraConfig" in message


def test_the_callback_syncs_trls_ref_adapter_on_a_stock_trainer(weights, tmp_path):
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer


    tok = AutoTokenizer.from_pretrained(weights)
    data = conversational("dpo").select(range(8))
    args = DPOConfig(**settings(tmp_path, max_steps=2), beta=0.1, max_length=None)
    policy = peft.get_peft_model(load(weights), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = DPOTrainer(policy, args=args, train_dataset=data, processing_class=tok)
    assert REFERENCE_ADAPTER in policy.peft_config  # TRL's own copy of the given adapter
    callback = HumanlineSyncCallback(trainer, SyncSchedule(every=1))
    trainer.add_callback(callback)
    trainer.train()
    assert [r.synced for r in callback.records] == [True, True] and callback.records[-1].bytes > 0

    plain = DPOTrainer(load(weights), args=args, train_dataset=data, processing_class=tok,
                       peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    plain.add_callback(HumanlineSyncCallback(plain, SyncSchedule(every=1)))
    with pytest.raises(HumanlineTrlSettingError) as info:  # TRL's reference is the base model: nothing to sync
        plain.train()
    assert "\n" not in str(info.value) and "ref_model" in str(info.value)


def test_a_resumed_lora_run_gives_the_uninterrupted_losses(weights, tmp_path, monkeypatch):
    """k = 3, 8 updates, resumed from checkpoint 4: the checkpoint holds the moved ``ref`` adapter (synced at update
    3) and the sync's state; TRL restores the ``default`` adapter and the optimizer."""
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from distributed.trl_data import lora_policy
    from hl_core.humanline import ClipTransform
    from hl_core.integrations.trl import HumanlineDPOTrainer

    tok = AutoTokenizer.from_pretrained(weights)

    def run(out, resume=None):
        args = DPOConfig(**settings(out, max_steps=8, save_strategy="steps", save_steps=4, learning_rate=1e-2),
                         beta=0.1, max_length=None)
        trainer = HumanlineDPOTrainer(lora_policy(weights, 0), args=args, train_dataset=dpo_rows(tok),
                                      processing_class=tok, transform=ClipTransform(-0.05, 0.05),
                                      schedule=SyncSchedule(every=3))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    saved = tmp_path / "whole" / "out" / "checkpoint-4"
    assert (saved / REFERENCE_ADAPTER).is_dir()  # transformers saves and reloads every adapter of the PeftModel...
    ours = tmp_path / "ours"
    shutil.copytree(saved, ours)
    shutil.rmtree(ours / REFERENCE_ADAPTER)  # ...so without it the moved reference comes from our file only
    resumed = run(tmp_path / "resumed", resume=str(ours))
    load = HumanlineSyncCallback._load  # the control: the counts, the initial `ref` adapter, not the moved one
    monkeypatch.setattr(HumanlineSyncCallback, "_load",
                        lambda self, state: load(self, {k: v for k, v in state.items() if k != "reference_shards"}))
    stale = run(tmp_path / "stale", resume=str(ours))
    losses, again, wrong = ([row["loss"] for row in t.humanline_history] for t in (whole, resumed, stale))
    gap = max(abs(a - b) for a, b in zip(losses[4:], again[4:]))
    print(f"LoRA DPO: updates 4-7 resumed vs whole, max |loss difference| {gap:.2e}")
    assert len(losses) == len(again) == 8 and gap <= 1e-5, (losses, again)
    assert [row["synced"] for row in resumed.humanline_history] == [n % 3 == 0 for n in range(8)]
    assert resumed.humanline_sync.sync.num_syncs == 3
    assert max(abs(a - b) for a, b in zip(losses[4:], wrong[4:])) > 1e-4, (losses, wrong)
