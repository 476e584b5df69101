"""A humanline TRL run resumed with ``resume_from_checkpoint`` from checkpoint 4 (k = 3, 8 updates) gives the
uninterrupted run's per-update losses within 1e-5 (DPO, KTO, GRPO; one CPU process): the checkpoint holds the moved
reference (synced at update 3, so no longer the initial weights) and the sync's state, and ``humanline_history``
keeps its sync marks. TRL's own DPO and KTO trainers, resumed the same way, are the control."""

import json

import pytest
import torch

from helpers import REPO
from hl_core.humanline import SyncSchedule
from test_own_loop import weights  # noqa: F401  (the fixture: the tiny model's saved random weights)
from test_trl_trainer_paths import dpo, grpo, kto

trl = pytest.importorskip("trl")
K, STEPS, SAVE = 3, 8, 4


def checksum(model):
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def humanline_losses(build, weights, out, resume=None):  # noqa: F811
    trainer = build(weights, out, args={"max_steps": STEPS, "save_strategy": "steps", "save_steps": SAVE},
                    schedule=SyncSchedule(every=K))
    initial = checksum(trainer.ref_model)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, initial


@pytest.mark.parametrize("build", [dpo, kto,
                                   grpo])
def test_a_resumed_humanline_run_gives_the_uninterrupted_losses(build, weights, tmp_path):  # noqa: F811
    whole, _ = humanline_losses(build, weights, tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "out" / f"checkpoint-{SAVE}"
    resumed, initial = humanline_losses(build, weights, tmp_path / "resumed", resume=str(checkpoint))
    losses = [row["loss"] for row in whole.humanline_history]
    again = [row["loss"] for row in resumed.humanline_history]
    gap = max(abs(a - b) for a, b in zip(losses[SAVE:], again[SAVE:]))
    print(f"{build.__name__}: updates {SAVE}-{STEPS - 1} resumed vs whole, max |loss difference| {gap:.2e}")
    assert len(again) == len(losses) == STEPS
    assert max(abs(a - b) for a, b in zip(losses[SAVE:], again[SAVE:])) <= 1e-5, (losses, again)
    marks = [n % K == 0 for n in range(STEPS)]
    assert [row["synced"] for row in whole.humanline_history] == marks
    assert [row["synced"] for row in resumed.humanline_history] == marks
    assert resumed.humanline_sync.sync.num_syncs == whole.humanline_sync.sync.num_syncs == 3
    assert abs(checksum(whole.ref_model) - initial) > 1e-6  # the reference moved: a fresh one would not do


def conversational(kind):
    """TRL's conversational rows from the tiny pairs: preference (DPO) or unpaired (KTO, chosen then rejected)."""
    from datasets import Dataset

    rows = [json.loads(line) for line in (REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text().splitlines()]
    if kind == "dpo":
        return Dataset.from_list([{"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:],
                                   "rejected": r["rejected"][-1:]} for r in rows[:64]])
    return Dataset.from_list([{"prompt": r[side][:-1], "completion": r[side][-1:], "label": side == "chosen"}
                              for r in rows[:64] for side in ("chosen", "rejected")])


def plain_losses(kind, weights, out, resume=None):  # noqa: F811
    """TRL's own trainer (a frozen reference) on TRL's conversational rows, its loss per update recorded from
    ``compute_loss``."""
    import trl_data
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from test_trl_trainer_paths import settings

    tok = AutoTokenizer.from_pretrained(weights)
    args = settings(out, max_steps=STEPS, save_strategy="steps", save_steps=SAVE)
    if kind == "dpo":
        cls, config = DPOTrainer, DPOConfig(**args, beta=0.1, max_length=None)
    else:
        args.update(per_device_train_batch_size=8)
        cls, config = KTOTrainer, KTOConfig(**args, beta=0.1, max_length=None)
    data = conversational(kind)
    trainer = cls(trl_data.load(weights), ref_model=trl_data.load(weights), args=config, train_dataset=data,
                  processing_class=tok)
    losses, compute_loss = [], trainer.compute_loss

    def recorded(*a, **k):
        loss = compute_loss(*a, **k)
        if trainer.model.training:
            losses.append(float(loss.detach()))
        return loss

    trainer.compute_loss = recorded
    trainer.train(resume_from_checkpoint=resume)
    return losses


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_the_control_trl_itself_resumes_exactly(kind, weights, tmp_path):  # noqa: F811
    whole = plain_losses(kind, weights, tmp_path / "whole")
    again = plain_losses(kind, weights, tmp_path / "resumed", str(tmp_path / "whole" / "out" / f"checkpoint-{SAVE}"))
    assert len(whole) == STEPS and len(again) == STEPS - SAVE
    assert max(abs(a - b) for a, b in zip(whole[SAVE:], again)) <= 1e-5, (whole, again)


def test_the_sync_file_holds_this_ranks_reference_shards_and_counts(weights, tmp_path):  # noqa: F811
    trainer, _ = humanline_losses(dpo, weights, tmp_path)
    state = torch.load(tmp_path / "out" / f"checkpoint-{SAVE}" / "humanline_sync_rank0.pt", weights_only=True)
    names = [name for name, _ in trainer.model.named_parameters()]
    assert sorted(state["reference_shards"]) == sorted(names) and state["num_syncs"] == 2  # updates 0 and 3


def test_without_the_saved_reference_the_resumed_losses_differ(weights, tmp_path):  # noqa: F811
    """The comparison can fail: the same resume with the reference shards removed from the sync file (so the
    reference is the initial weights, as before they were saved) gives other losses."""
    import shutil

    whole, _ = humanline_losses(dpo, weights, tmp_path / "whole")
    checkpoint = tmp_path / "bare"
    shutil.copytree(tmp_path / "whole" / "out" / f"checkpoint-{SAVE}", checkpoint)
    state = torch.load(checkpoint / "humanline_sync_rank0.pt", weights_only=True)
    del state["reference_shards"]  # the counts stay: only the moved reference is lost
    torch.save(state, checkpoint / "humanline_sync_rank0.pt")
    resumed, _ = humanline_losses(dpo, weights, tmp_path / "resumed", resume=str(checkpoint))
    losses = [row["loss"] for row in whole.humanline_history]
    again = [row["loss"] for row in resumed.humanline_history]
    assert max(abs(a - b) for a, b in zip(losses[SAVE:SAVE + 2], again[SAVE:SAVE + 2])) > 1e-4, (losses, again)


def test_a_checkpoint_without_the_sync_file_or_of_another_layout_is_refused(weights, tmp_path):  # noqa: F811
    """Resuming where this rank's ``humanline_sync_rank<r>.pt`` is missing (a stock trainer's checkpoint, or more
    processes than saved it), or holds shards of another layout, is one paragraph, not a silent initial reference
    or a traceback."""
    import shutil

    from hl_core.integrations.trl import HumanlineTrlSettingError

    humanline_losses(dpo, weights, tmp_path / "whole")
    saved = tmp_path / "whole" / "out" / f"checkpoint-{SAVE}"
    missing, other = tmp_path / "missing", tmp_path / "other"
    shutil.copytree(saved, missing, ignore=shutil.ignore_patterns("humanline_sync_rank*.pt"))
    shutil.copytree(saved, other)
    state = torch.load(other / "humanline_sync_rank0.pt", weights_only=True)
    name = next(iter(state["reference_shards"]))
    state["reference_shards"][name] = state["reference_shards"][name].flatten()[:7]  # another rank's partition
    torch.save(state, other / "humanline_sync_rank0.pt")
    for checkpoint, says in ((missing, "humanline_sync_rank0.pt"), (other, name)):
        with pytest.raises(HumanlineTrlSettingError) as info:
            humanline_losses(dpo, weights, tmp_path / checkpoint.name, resume=str(checkpoint))
        assert "\n" not in str(info.value) and says in str(info.value) and "Fix:" in str(info.value)
