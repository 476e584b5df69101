"""The TRL adapter's door: every kind of bad input ends in one paragraph (``HumanlineTrlSettingError``, a
``UserError``: exit code 2 on the command line) naming the argument, field or file and the fix, before anything
is computed with it, and a refused resume changes nothing (the model, the reference, the transform and the history
are as they were). One case of each kind:

* keyword objects of the wrong kind (``transform="clip"``, the class ``ClipTransform``, ``schedule=2``) and
  keywords a ``Humanline*Config`` disagrees with, at construction;
* config fields out of range (bounds, the transform's name, the sync's period, offset and mix, non-finite or
  non-positive Beta parameters, which would hang the sampler), and ``sync_ref_model`` with humanline;
* a second ``HumanlineSyncCallback`` on one trainer or one reference;
* resumes from a damaged or foreign checkpoint: a truncated, bit-flipped, NaN, other-dtype, extra-shard or
  missing-key sync file, a truncated or edited ``humanline_state.json``, a missing sync file, another schedule or
  transform, another model size, no checkpoint at all; and a pickle payload planted in every file of a checkpoint:
  nothing of it runs (DeepSpeed's files: ``test_trl_deepspeed_door.py``).
"""

import json
import math
import os
import shutil

import pytest
import torch

from helpers import REPO
from trl_common import checksum, dpo

trl = pytest.importorskip("trl")

from hl_core.errors import UserError  # noqa: E402
from hl_core.humanline import ClipTransform, NoTransform, SampleTransform, SyncSchedule  # noqa: E402
from hl_core.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineDPOTrainer,
    HumanlineGRPOConfig,
    HumanlineGRPOTrainer,
    HumanlineKTOTrainer,
    HumanlineSyncCallback,
    HumanlineTrlSettingError,
)
from hl_core.integrations.trl.checkpoint import digest  # noqa: E402

SAVE, K = 2, 3


def one_paragraph(info, *says):
    message = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in message and "Fix:" in message, message
    for text in says:
        assert text in message, message
    return message


# ------------------------------------------------------------------------------------------------ keyword objects
@pytest.mark.parametrize("cls", [HumanlineDPOTrainer, HumanlineKTOTrainer, HumanlineGRPOTrainer])
@pytest.mark.parametrize("keywords, says", [
    ({"transform": "clip"}, ["`transform='clip'`", "ClipTransform()", 'humanline_transform="clip"']),
    ({"transform": ClipTransform}, ["this is its class", "`transform=ClipTransform()`"]),
    ({"transform": 0.5}, ["`transform=0.5`", "ClipTransform(log_eps_P, log_eps_R)"]),
    ({"schedule": 2}, ["`schedule=2`", "`schedule=SyncSchedule(every=2)`"]),
    ({"schedule": {"every": 2}}, ["`schedule={'every': 2}`", "SyncSchedule(every=k)"]),
], ids=["transform-str", "transform-class", "transform-number", "schedule-int", "schedule-dict"])
def test_a_keyword_of_the_wrong_kind_is_refused_at_construction(cls, keywords, says):
    extra = {"reward_funcs": []} if cls is HumanlineGRPOTrainer else {}
    with pytest.raises(HumanlineTrlSettingError) as info:
        cls("unused-model", args=None, train_dataset=None, **extra, **keywords)  # refused before any model loads
    one_paragraph(info, *says)


@pytest.mark.parametrize("fields, keywords, says", [
    ({"humanline": True}, {"transform": ClipTransform(-0.05, 0.05)},
     ["`transform=ClipTransform(log_eps_P=-0.05, log_eps_R=0.05)` disagrees", "ClipTransform(log_eps_P=-1.5"]),
    ({"humanline": True, "humanline_sync_freq": 4}, {"schedule": SyncSchedule(every=2)},
     ["`schedule=SyncSchedule(every=2, offset=0, mix=1.0)` disagrees", "SyncSchedule(every=4"]),
    ({"humanline": False}, {"schedule": SyncSchedule(every=2)}, ["`schedule=` given with a config whose `humanline`"
                                                                  " is False"]),
], ids=["transform", "schedule", "humanline-off"])
def test_a_keyword_the_config_disagrees_with_is_refused(fields, keywords, says, tmp_path):
    config = HumanlineDPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **fields)
    with pytest.raises(HumanlineTrlSettingError) as info:
        HumanlineDPOTrainer("unused-model", args=config, train_dataset=None, **keywords)
    one_paragraph(info, *says)


def test_keywords_that_agree_with_the_config_are_accepted(weights, tmp_path):
    trainer = dpo(weights, tmp_path, config_class=HumanlineDPOConfig, args={"humanline": True},
                  transform=ClipTransform(), schedule=SyncSchedule(every=1))
    assert trainer.humanline_enabled and trainer.humanline_transform.log_eps_P == -1.5


# ------------------------------------------------------------------------------------------------ config fields
@pytest.mark.parametrize("fields, says", [
    ({"humanline_log_eps_P": 0.5}, "`humanline_log_eps_P=0.5`"),
    ({"humanline_log_eps_R": float("nan")}, "`humanline_log_eps_R=nan`"),
    ({"humanline_transform": "clamp"}, "`humanline_transform='clamp'`"),
    ({"humanline_sync_freq": 0}, "`humanline_sync_freq=0`"),
    ({"humanline_sync_freq": 1.5}, "`humanline_sync_freq=1.5`"),
    ({"humanline_sync_freq": 2, "humanline_sync_offset": 2}, "`humanline_sync_offset=2`"),
    ({"humanline_sync_mix": 1.5}, "`humanline_sync_mix=1.5`"),
    ({"humanline_beta_R": float("inf")}, "`humanline_beta_R=inf`"),
    ({"humanline_gamma_P": 0.0}, "`humanline_gamma_P=0.0`"),
    ({"humanline_sample_seed": "one"}, "`humanline_sample_seed='one'`"),
    ({"humanline": True, "sync_ref_model": True}, "`sync_ref_model=True` cannot be combined with `humanline=True`"),
], ids=lambda v: "-".join(v) if isinstance(v, dict) else "")
def test_a_config_field_out_of_range_is_refused_when_the_config_is_made(fields, says, tmp_path):
    with pytest.raises(HumanlineTrlSettingError) as info:
        HumanlineGRPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, **fields)
    one_paragraph(info, says)


def test_a_sample_transform_with_an_infinite_beta_never_reaches_the_sampler(tmp_path):
    """The hang of issue 53 (``SampleTransform(beta_R=inf)``'s first call never returns): through the config it is
    refused before any transform exists; a valid config builds one, seeded per rank."""
    with pytest.raises(HumanlineTrlSettingError):
        HumanlineDPOConfig(output_dir=str(tmp_path), bf16=False, humanline=True, humanline_transform="sample",
                           humanline_beta_R=math.inf)
    from hl_core.integrations.trl.config import settings

    config = HumanlineDPOConfig(output_dir=str(tmp_path), bf16=False, humanline=True, humanline_transform="sample",
                                seed=7)
    chosen = settings(config)
    assert isinstance(chosen.transform, SampleTransform) and chosen.transform.seed == 7


# --------------------------------------------------------------------------------------------- one sync per reference
def test_a_second_sync_callback_on_a_humanline_trainer_is_refused(weights, tmp_path):
    trainer = dpo(weights, tmp_path)
    with pytest.raises(HumanlineTrlSettingError) as info:
        HumanlineSyncCallback(trainer, SyncSchedule(every=2))
    one_paragraph(info, "already has a HumanlineSyncCallback", "sync the reference twice")


def test_two_sync_callbacks_on_one_stock_trainer_are_refused_when_training_starts(weights, tmp_path):
    from transformers import AutoTokenizer

    from distributed.trl_data import load
    from trl_common import conversational, settings

    tok = AutoTokenizer.from_pretrained(weights)
    trainer = trl.DPOTrainer(load(weights), ref_model=load(weights), processing_class=tok,
                             args=trl.DPOConfig(**settings(tmp_path, max_steps=1), beta=0.1, max_length=None),
                             train_dataset=conversational("dpo").select(range(8)))
    first, second = HumanlineSyncCallback(trainer, SyncSchedule()), HumanlineSyncCallback(trainer, SyncSchedule())
    trainer.add_callback(first)
    trainer.add_callback(second)
    before = checksum(trainer.ref_model)
    with pytest.raises(HumanlineTrlSettingError) as info:
        trainer.train()
    one_paragraph(info, "already synced by another HumanlineSyncCallback or ReferenceSync", "sync it twice")
    assert checksum(trainer.ref_model) == before  # refused before any update


def test_a_schedule_of_the_wrong_kind_on_the_callback_is_refused(weights, tmp_path):
    trainer = dpo(weights, tmp_path, schedule=None)
    trainer.remove_callback(trainer.humanline_sync)
    with pytest.raises(HumanlineTrlSettingError) as info:
        HumanlineSyncCallback(trainer, 4)
    one_paragraph(info, "`SyncSchedule(every=4)`")


# ------------------------------------------------------------------------------------------------------ resumes
@pytest.fixture(scope="module")
def trained(weights, tmp_path_factory):
    """A humanline DPO trainer (k = 3) trained 2 updates with a checkpoint at 2: the trainer every refused resume
    below is tried on, and what it holds before."""
    out = tmp_path_factory.mktemp("trained")
    trainer = dpo(weights, out, schedule=SyncSchedule(every=K),
                  args={"max_steps": SAVE, "save_strategy": "steps", "save_steps": SAVE})
    trainer.train()
    return trainer, out / "out" / f"checkpoint-{SAVE}"


def snapshot(trainer):
    return (checksum(trainer.model), checksum(trainer.ref_model), json.dumps(trainer.humanline_history),
            trainer.humanline_sync.sync.num_syncs, trainer.state.global_step)


def copy_of(checkpoint, tmp_path):
    target = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, target)
    return target


def rewrite_sync(path, edit, keep_checksum=False):
    payload = torch.load(path, weights_only=True)
    checksum_ = payload.pop("checksum")
    edit(payload)
    payload["checksum"] = checksum_ if keep_checksum else digest(payload)
    torch.save(payload, path)


def rewrite_state(path, edit):
    state = json.loads(path.read_text())
    state.pop("checksum")
    edit(state)
    state["checksum"] = digest(state)
    path.write_text(json.dumps(state))


def first_shard(payload):
    return next(iter(payload["sync"]["reference_shards"]))


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path):
    def flip(payload):
        shard = payload["sync"]["reference_shards"][first_shard(payload)]
        shard.view(-1)[0] += 1.0

    rewrite_sync(path, flip, keep_checksum=True)


DAMAGE = {
    "truncated sync file": ("humanline_sync_rank0.pt", _truncate, "humanline_sync_rank0.pt` is not a readable"),
    "bit-flipped shard": ("humanline_sync_rank0.pt", _flip_a_byte, "fails its checksum"),
    "NaN shard": ("humanline_sync_rank0.pt", lambda p: rewrite_sync(
        p, lambda s: s["sync"]["reference_shards"][first_shard(s)].view(-1).__setitem__(0, float("nan"))),
        "NaN or inf"),
    "other dtype": ("humanline_sync_rank0.pt", lambda p: rewrite_sync(
        p, lambda s: s["sync"]["reference_shards"].update({first_shard(s): s["sync"]["reference_shards"][
            first_shard(s)].double()})), "torch.float64 where the reference holds torch.float32"),
    "extra shard": ("humanline_sync_rank0.pt", lambda p: rewrite_sync(
        p, lambda s: s["sync"]["reference_shards"].update({"extra.weight": torch.zeros(2)})), "extra ['extra.weight']"),
    "missing key": ("humanline_sync_rank0.pt", lambda p: rewrite_sync(p, lambda s: s["sync"].pop("schedule")),
                    "holds a sync state with keys"),
    "wrong count": ("humanline_sync_rank0.pt", lambda p: rewrite_sync(
        p, lambda s: s["sync"].update(updates_seen="2")), "counts '2' updates"),
    "truncated state file": ("humanline_state.json", _truncate, "humanline_state.json` is not valid JSON"),
    "edited state file": ("humanline_state.json", lambda p: p.write_text(
        p.read_text().replace('"loss": 0.', '"loss": 1.')), "humanline_state.json` fails its checksum"),
    "state rows of the wrong type": ("humanline_state.json", lambda p: rewrite_state(
        p, lambda s: s.update(history="none")), "sync marks or rows of the wrong types"),
    "missing sync file": ("humanline_sync_rank0.pt", os.remove, "holds no `humanline_sync_rank0.pt`"),
    "truncated trainer state": ("trainer_state.json", _truncate, "trainer_state.json` is not valid JSON"),
    "truncated model weights": ("model.safetensors", _truncate, "model.safetensors` is not a readable safetensors"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_refused_in_one_paragraph_and_nothing_changes(damage, trained, tmp_path):
    trainer, checkpoint = trained
    name, edit, says = DAMAGE[damage]
    planted = copy_of(checkpoint, tmp_path)
    edit(planted / name)
    before = snapshot(trainer)
    with pytest.raises(HumanlineTrlSettingError) as info:
        trainer.train(resume_from_checkpoint=str(planted))
    one_paragraph(info, says, f"`{planted}`", "Nothing was loaded")
    assert snapshot(trainer) == before


@pytest.fixture(scope="module")
def trained_sampling(weights, tmp_path_factory):
    """As ``trained``, with humanline sampling: its checkpoint holds the generators' state."""
    out = tmp_path_factory.mktemp("trained_sampling")
    trainer = dpo(weights, out, schedule=SyncSchedule(every=K), transform=SampleTransform(seed=3),
                  args={"max_steps": SAVE, "save_strategy": "steps", "save_steps": SAVE})
    trainer.train()
    return trainer, out / "out" / f"checkpoint-{SAVE}"


@pytest.mark.parametrize("state, says", [
    (lambda cpu: {"meta": cpu}, "generator state for device `meta`"),
    (lambda cpu: {"cpu": cpu[:100]}, "generator state for `cpu` that is no such state"),
    (lambda cpu: {"cpu": cpu.float()}, "generator state for `cpu` that is no such state"),
], ids=["other-device", "cut-short", "other-dtype"])
def test_a_generator_state_this_process_cannot_restore_is_refused(state, says, trained_sampling, tmp_path):
    trainer, checkpoint = trained_sampling
    planted = copy_of(checkpoint, tmp_path)
    rewrite_sync(planted / "humanline_sync_rank0.pt", lambda p: p.update(transform=state(p["transform"]["cpu"])))
    before = snapshot(trainer), trainer.humanline_transform.state_dict()["cpu"].clone()
    with pytest.raises(HumanlineTrlSettingError) as info:
        trainer.train(resume_from_checkpoint=str(planted))
    one_paragraph(info, says)
    assert snapshot(trainer) == before[0] and torch.equal(trainer.humanline_transform.state_dict()["cpu"], before[1])


@pytest.mark.parametrize("keywords, says", [
    ({"schedule": SyncSchedule(every=2)}, "with the sync schedule {'every': 3, 'offset': 0, 'mix': 1.0}"),
    ({"transform": NoTransform(-0.05, 0.05)}, "`transform` = 'ClipTransform(log_eps_P=-0.05, log_eps_R=0.05)'"),
], ids=["schedule", "transform"])
def test_a_resume_with_other_humanline_settings_is_refused(keywords, says, trained, weights, tmp_path):
    _, checkpoint = trained
    trainer = dpo(weights, tmp_path, **{"schedule": SyncSchedule(every=K), **keywords})
    with pytest.raises(HumanlineTrlSettingError) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    one_paragraph(info, says)


def test_a_checkpoint_of_another_model_size_is_refused_before_transformers_reads_it(trained, tmp_path):
    """The tiny model's checkpoint resumed into a model with 2 attention heads of 32 (not 4 of 16): without the
    adapter's check, transformers fails inside its weight loading with a size-mismatch traceback."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _, checkpoint = trained
    other = tmp_path / "other"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "tests/fixtures/tiny/model_hd32"),
                                     dtype=torch.float32).save_pretrained(other)
    AutoTokenizer.from_pretrained(REPO / "tests/fixtures/tiny/model").save_pretrained(other)
    trainer = dpo(other, tmp_path, schedule=SyncSchedule(every=K))
    with pytest.raises(HumanlineTrlSettingError) as info:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    one_paragraph(info, "a checkpoint of another model", "`num_attention_heads: 4`")


def test_resume_true_without_a_checkpoint_is_refused(weights, tmp_path):
    with pytest.raises(HumanlineTrlSettingError) as info:
        dpo(weights, tmp_path).train(resume_from_checkpoint=True)
    one_paragraph(info, "found no `checkpoint-N` folder")


# ---------------------------------------------------------------------------------------------- planted payloads
class Payload:
    """Unpickling this creates ``marker`` (a file): code, where a checkpoint holds weights."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


NEVER_READ = {"training_args.bin", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json"}  # a resume reads none of them: it trains on, and nothing runs


def test_a_payload_planted_in_any_file_of_a_checkpoint_never_runs(trained, weights, tmp_path):
    """Each file of a humanline DPO checkpoint in turn replaced by a pickle whose loading would create a marker
    file: every file a resume reads is refused in one paragraph naming it (and nothing changes); the files a resume
    never reads (``NEVER_READ``) leave it training on. The marker never appears."""
    trainer, checkpoint = trained
    marker = tmp_path / "payload-ran"
    files = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*") if p.is_file())
    assert {"optimizer.pt", "scheduler.pt", "rng_state.pth", "model.safetensors", "trainer_state.json",
            "humanline_sync_rank0.pt", "humanline_state.json"} <= {str(f) for f in files}
    refused, trained_on = [], []
    for index, name in enumerate(files):
        planted = tmp_path / f"planted{index}"
        shutil.copytree(checkpoint, planted)
        torch.save({"state": Payload(marker)}, planted / name)
        if str(name) in NEVER_READ:
            dpo(weights, tmp_path / f"run{index}", schedule=SyncSchedule(every=K),
                args={"max_steps": SAVE + 1}).train(resume_from_checkpoint=str(planted))
            trained_on.append(str(name))
        else:
            before = snapshot(trainer)
            with pytest.raises(HumanlineTrlSettingError) as info:
                trainer.train(resume_from_checkpoint=str(planted))
            one_paragraph(info, f"`{name}`")
            assert snapshot(trainer) == before
            refused.append(str(name))
        assert not marker.exists(), f"the payload in {name} ran"
    print(f"refused: {refused}; trained on (never read): {trained_on}")
    assert set(trained_on) == NEVER_READ & {str(f) for f in files}
