"""Humanline's settings as config fields (``HumanlineDPOConfig``, ``HumanlineKTOConfig``, ``HumanlineGRPOConfig``):

* a run configured by the config alone gives the per-update losses of the keyword path (``transform=``,
  ``schedule=`` with TRL's own config) within 1e-6 (DPO, KTO, GRPO), and a config with another sync period does not;
* ``humanline=False`` is TRL's own trainer: the same per-update losses as ``DPOTrainer``, ``KTOTrainer`` and
  ``GRPOTrainer`` (generating, with a reward function) within 1e-6, where ``humanline=True`` differs;
* a run resumed from a checkpoint with the config alone gives the uninterrupted losses exactly (gap 0.0);
* the fields travel in the checkpoint's ``training_args.bin`` and its ``humanline_state.json``, and a resume whose
  fields differ is refused naming the field; the fields parse with ``TrlParser`` (YAML and flags, as TRL's own).
"""

import json
import zipfile

import pytest

from helpers import REPO
from trl_common import conversational, dpo, grpo, kto, recorded, settings

trl = pytest.importorskip("trl")

from hl_core.humanline import ClipTransform, SyncSchedule  # noqa: E402
from hl_core.integrations.trl import (  # noqa: E402
    HumanlineDPOConfig,
    HumanlineGRPOConfig,
    HumanlineKTOConfig,
    HumanlineTrlSettingError,
)

BUILDS = {"dpo": (dpo, HumanlineDPOConfig), "kto": (kto, HumanlineKTOConfig), "grpo": (grpo, HumanlineGRPOConfig)}
FIELDS = {"humanline": True, "humanline_log_eps_P": -0.05, "humanline_log_eps_R": 0.05, "humanline_sync_freq": 2}
STEPS = 4


def losses(trainer):
    return [row["loss"] for row in trainer.humanline_history]


def by_config(kind, weights, out, **fields):
    build, config_class = BUILDS[kind]
    trainer = build(weights, out, config_class=config_class, config_only=True,
                    args={"max_steps": STEPS, **FIELDS, **fields})
    trainer.train()
    return trainer


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo"])
def test_the_config_alone_gives_the_keyword_paths_losses(kind, weights, tmp_path):
    build, _ = BUILDS[kind]
    keywords = build(weights, tmp_path / "keywords", args={"max_steps": STEPS},
                     transform=ClipTransform(-0.05, 0.05), schedule=SyncSchedule(every=2))
    keywords.train()
    config = by_config(kind, weights, tmp_path / "config")
    gap = max(abs(a - b) for a, b in zip(losses(keywords), losses(config)))
    print(f"{kind}: config alone vs keywords, max |loss difference| {gap:.2e}")
    assert len(losses(config)) == STEPS and gap <= 1e-6, (losses(keywords), losses(config))
    assert [r["synced"] for r in config.humanline_history] == [True, False, True, False]
    other = by_config(kind, weights, tmp_path / "other", humanline_sync_freq=3)  # the comparison can fail
    assert max(abs(a - b) for a, b in zip(losses(keywords), losses(other))) > 1e-4


def reward_length(completions, **kwargs):
    """A deterministic reward: the completion's length."""
    return [float(len(str(c))) for c in completions]


def trl_format_trainer(kind, cls, config_class, weights, out, **fields):
    """``cls`` on TRL-format rows (TRL tokenizes): conversational pairs (DPO, KTO) or prompts to generate from
    (GRPO, a length reward), with ``config_class`` (TRL's, or ours with ``fields``)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from distributed.trl_data import load

    tok = AutoTokenizer.from_pretrained(weights)
    args = settings(out, max_steps=STEPS, **fields)
    if kind == "grpo":
        rows = [{"prompt": [{"role": "user", "content": json.loads(line)["prompt"]}]} for line in
                (REPO / "tests/fixtures/tiny/groups/train.jsonl").read_text().splitlines()[:16]]
        config = config_class(**{**args, "per_device_train_batch_size": 8}, num_generations=4,
                              max_completion_length=8, beta=0.0, loss_type="bnpo")
        return cls(load(weights), reward_funcs=reward_length, args=config, train_dataset=Dataset.from_list(rows),
                   processing_class=tok)
    batch = {"per_device_train_batch_size": 8} if kind == "kto" else {}
    config = config_class(**{**args, **batch}, beta=0.1, max_length=None)
    return cls(load(weights), ref_model=load(weights), args=config, train_dataset=conversational(kind),
               processing_class=tok)


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo"])
def test_humanline_false_is_trls_own_trainer(kind, weights, tmp_path):
    from hl_core.integrations.trl import HumanlineDPOTrainer, HumanlineGRPOTrainer, HumanlineKTOTrainer

    trl_class = {"dpo": trl.DPOTrainer, "kto": trl.KTOTrainer, "grpo": trl.GRPOTrainer}[kind]
    ours = {"dpo": HumanlineDPOTrainer, "kto": HumanlineKTOTrainer, "grpo": HumanlineGRPOTrainer}[kind]
    trl_config = {"dpo": trl.DPOConfig, "kto": trl.KTOConfig, "grpo": trl.GRPOConfig}[kind]
    runs = {}
    for name, cls, config_class, fields in (
            ("trl", trl_class, trl_config, {}),
            ("off", ours, BUILDS[kind][1], {"humanline": False}),
            ("on", ours, BUILDS[kind][1], FIELDS)):
        trainer = trl_format_trainer(kind, cls, config_class, weights, tmp_path / name, **fields)
        runs[name] = recorded(trainer)
        trainer.train()
    gap = max(abs(a - b) for a, b in zip(runs["trl"], runs["off"]))
    print(f"{kind}: humanline=False vs TRL's {trl_class.__name__}, max |loss difference| {gap:.2e}")
    assert len(runs["off"]) == len(runs["trl"]) == STEPS and gap <= 1e-6, runs
    assert max(abs(a - b) for a, b in zip(runs["trl"], runs["on"])) > 1e-4, runs  # humanline changes them


@pytest.mark.parametrize("kind", ["dpo", "kto", "grpo"])
def test_a_resume_from_the_config_alone_is_exact(kind, weights, tmp_path):
    saving = {"max_steps": 8, "save_strategy": "steps", "save_steps": 4}
    build, config_class = BUILDS[kind]

    def run(out, resume=None):
        trainer = build(weights, out, config_class=config_class, config_only=True,
                        args={**saving, **FIELDS, "humanline_sync_freq": 3})
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    checkpoint = tmp_path / "whole" / "out" / "checkpoint-4"
    resumed = run(tmp_path / "resumed", str(checkpoint))
    gap = max(abs(a - b) for a, b in zip(losses(whole)[4:], losses(resumed)[4:]))
    print(f"{kind}: config alone, resumed from checkpoint 4 vs whole, max |loss difference| {gap:.2e}")
    assert len(losses(resumed)) == 8 and gap == 0.0, (losses(whole), losses(resumed))
    with zipfile.ZipFile(checkpoint / "training_args.bin") as archive:  # the pickled config, read as bytes only
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert all(name.encode() in pickled for name in FIELDS) and config_class.__name__.encode() in pickled
    saved = json.loads((checkpoint / "humanline_state.json").read_text())["settings"]
    assert saved["transform"] == "ClipTransform(log_eps_P=-0.05, log_eps_R=0.05)"
    assert saved["schedule"] == "SyncSchedule(every=3, offset=0, mix=1.0)"
    with pytest.raises(HumanlineTrlSettingError) as info:  # the fields are used on resume: others are refused
        trainer = build(weights, tmp_path / "other", config_class=config_class, config_only=True,
                        args={**saving, **FIELDS, "humanline_sync_freq": 3, "humanline_log_eps_R": 0.5})
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "`transform` = 'ClipTransform(log_eps_P=-0.05, log_eps_R=0.05)'" in str(info.value)
    assert "\n" not in str(info.value) and "Fix:" in str(info.value)


def test_the_fields_parse_as_trls_own_from_yaml_and_flags(tmp_path):
    from trl import TrlParser

    path = tmp_path / "config.yaml"
    path.write_text("output_dir: out\nbf16: false\nhumanline: true\nhumanline_log_eps_P: -0.5\n"
                    "humanline_transform: sample\nhumanline_sync_freq: 4\nbeta: 0.2\n")
    (config,) = TrlParser((HumanlineDPOConfig,)).parse_args_and_config(
        ["--config", str(path), "--humanline_sync_offset", "1", "--humanline_gamma_R", "0.02"])
    assert (config.humanline, config.humanline_log_eps_P, config.humanline_transform, config.humanline_sync_freq,
            config.humanline_sync_offset, config.humanline_gamma_R, config.beta) == (True, -0.5, "sample", 4, 1,
                                                                                     0.02, 0.2)
    help_text = TrlParser((HumanlineDPOConfig,)).format_help()
    assert "--humanline_sync_freq" in help_text and "Number of optimizer updates between two syncs" in help_text
