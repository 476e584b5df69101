"""A humanline TRL run resumed with ``resume_from_checkpoint`` from checkpoint 4 (k = 3, 8 updates) gives the
uninterrupted run's per-update losses exactly (gap 0.0; DPO, KTO, GRPO; one CPU process), with the clip and with
humanline sampling (``SampleTransform(seed=...)``, whose generators the checkpoint keeps): the checkpoint holds the
moved reference (synced at update 3, so no longer the initial weights), the sync's state and the transform's, and
``humanline_history`` keeps its sync marks. TRL's own DPO and KTO trainers, resumed the same way, are the control;
so are resumes that leave out the moved reference, or the generators' state: their losses differ."""

import pytest
import torch

from trl_common import checksum, conversational, dpo, grpo, kto, recorded, settings

trl = pytest.importorskip("trl")

from hl_core.humanline import SampleTransform, SyncSchedule  # noqa: E402
from hl_core.integrations.trl import HumanlineSyncCallback  # noqa: E402

K, STEPS, SAVE = 3, 8, 4


def humanline_run(build, weights, out, resume=None, **keywords):
    trainer = build(weights, out, args={"max_steps": STEPS, "save_strategy": "steps", "save_steps": SAVE},
                    schedule=SyncSchedule(every=K), **keywords)
    initial = checksum(trainer.ref_model)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, initial


def losses(trainer):
    return [row["loss"] for row in trainer.humanline_history]


def resume_gap(whole, resumed) -> float:
    a, b = losses(whole), losses(resumed)
    assert len(a) == len(b) == STEPS
    return max(abs(x - y) for x, y in zip(a[SAVE:], b[SAVE:]))


@pytest.mark.parametrize("build", [dpo, kto,
                                   grpo])
def test_a_resumed_humanline_run_gives_the_uninterrupted_losses(build, weights, tmp_path):
    whole, _ = humanline_run(build, weights, tmp_path / "whole")
    resumed, initial = humanline_run(build, weights, tmp_path / "resumed",
                                     resume=str(tmp_path / "whole" / "out" / f"checkpoint-{SAVE}"))
    gap = resume_gap(whole, resumed)
    print(f"{build.__name__}: updates {SAVE}-{STEPS - 1} resumed vs whole, max |loss difference| {gap:.2e}")
    assert gap == 0.0, (losses(whole), losses(resumed))
    marks = [n % K == 0 for n in range(STEPS)]
    assert [row["synced"] for row in whole.humanline_history] == marks
    assert [row["synced"] for row in resumed.humanline_history] == marks
    assert resumed.humanline_sync.sync.num_syncs == whole.humanline_sync.sync.num_syncs == 3
    assert abs(checksum(whole.ref_model) - initial) > 1e-6  # the reference moved: a fresh one would not do


@pytest.mark.parametrize("build", [dpo, kto,
                                   grpo])
def test_a_resumed_run_with_humanline_sampling_gives_the_uninterrupted_losses(build, weights, tmp_path,
                                                                           monkeypatch):
    """``SampleTransform(seed=5)``: the checkpoint holds each rank's generator state, so the resumed draws are the
    uninterrupted run's (gap 0.0). The control: the same resume with the generator state left out draws afresh
    from the seed, and its losses differ."""
    whole, _ = humanline_run(build, weights, tmp_path / "whole", transform=SampleTransform(seed=5))
    checkpoint = str(tmp_path / "whole" / "out" / f"checkpoint-{SAVE}")
    resumed, _ = humanline_run(build, weights, tmp_path / "resumed", resume=checkpoint,
                               transform=SampleTransform(seed=5))
    gap = resume_gap(whole, resumed)
    print(f"{build.__name__}, humanline sampling: updates {SAVE}-{STEPS - 1} resumed vs whole, "
          f"max |loss difference| {gap:.2e}")
    assert gap == 0.0, (losses(whole), losses(resumed))
    assert max(row["clipped_frac"] for row in whole.humanline_history) > 0.05  # tokens were rejected

    restore = HumanlineSyncCallback.restore
    monkeypatch.setattr(HumanlineSyncCallback, "restore",
                        lambda self, resume: restore(self, resume and type(resume)(resume.sync, None, resume.rows)))
    fresh, _ = humanline_run(build, weights, tmp_path / "fresh", resume=checkpoint, transform=SampleTransform(seed=5))
    print(f"{build.__name__}, humanline sampling, the control without the generators' state: max |loss difference| "
          f"{resume_gap(whole, fresh):.2e}")
    assert resume_gap(whole, fresh) > 1e-4, (losses(whole), losses(fresh))


def plain_losses(kind, weights, out, resume=None):
    """TRL's own trainer (a frozen reference) on TRL's conversational rows, its loss per update recorded from
    ``compute_loss``."""
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from distributed.trl_data import load

    tok = AutoTokenizer.from_pretrained(weights)
    args = settings(out, max_steps=STEPS, save_strategy="steps", save_steps=SAVE)
    if kind == "dpo":
        cls, config = DPOTrainer, DPOConfig(**args, beta=0.1, max_length=None)
    else:
        args.update(per_device_train_batch_size=8)
        cls, config = KTOTrainer, KTOConfig(**args, beta=0.1, max_length=None)
    trainer = cls(load(weights), ref_model=load(weights), args=config, train_dataset=conversational(kind),
                  processing_class=tok)
    losses_seen = recorded(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return losses_seen


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_the_control_trl_itself_resumes_exactly(kind, weights, tmp_path):
    whole = plain_losses(kind, weights, tmp_path / "whole")
    again = plain_losses(kind, weights, tmp_path / "resumed", str(tmp_path / "whole" / "out" / f"checkpoint-{SAVE}"))
    assert len(whole) == STEPS and len(again) == STEPS - SAVE
    assert max(abs(a - b) for a, b in zip(whole[SAVE:], again)) <= 1e-5, (whole, again)


def test_the_sync_file_holds_this_ranks_reference_shards_and_counts(weights, tmp_path):
    trainer, _ = humanline_run(dpo, weights, tmp_path)
    payload = torch.load(tmp_path / "out" / f"checkpoint-{SAVE}" / "humanline_sync_rank0.pt", weights_only=True)
    names = [name for name, _ in trainer.model.named_parameters()]
    assert sorted(payload) == ["checksum", "format", "sync", "transform"] and not payload["transform"]
    assert sorted(payload["sync"]["reference_shards"]) == sorted(names) and payload["sync"]["num_syncs"] == 2


def test_without_the_saved_reference_the_resumed_losses_differ(weights, tmp_path, monkeypatch):
    """The comparison can fail: the same resume with the reference shards left out when the sync state is loaded
    (so the reference is the initial weights, as before they were saved) gives other losses."""
    whole, _ = humanline_run(dpo, weights, tmp_path / "whole")
    load = HumanlineSyncCallback._load
    monkeypatch.setattr(HumanlineSyncCallback, "_load",
                        lambda self, state: load(self, {k: v for k, v in state.items() if k != "reference_shards"}))
    resumed, _ = humanline_run(dpo, weights, tmp_path / "resumed",
                               resume=str(tmp_path / "whole" / "out" / f"checkpoint-{SAVE}"))
    assert resume_gap(whole, resumed) > 1e-4, (losses(whole), losses(resumed))
