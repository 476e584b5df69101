"""Shared by tests/test_trl_*.py: the tiny model's saved weights (``weights``), the humanline TRL trainers built on
them in this process (``dpo``, ``kto``, ``grpo``), and the pack's per-update losses on a tiny recipe against a
humanline TRL trainer's in subprocesses (``pack_losses``, ``trl_run``), on the same token ids in the same order
(fp32, CPU, k = 2, bounds that bind)."""

import json

from helpers import REPO, read_jsonl, run_recipe, run_torchrun

RUN = REPO / "tests" / "distributed" / "trl_run.py"
STEPS, K = 8, 2
CLIP = (-0.05, 0.05)  # binds on well over 5% of the tokens once the policy moves


def pack_losses(recipe, weights, tmp_path, *overrides, nproc=1):
    """``launchers/run.py RECIPE`` from ``weights``, rows in file order, a constant learning rate (TRL's warm-up
    starts at 0, ours at 1/warmup: both without one), the reference a copy synced every K updates."""
    out = tmp_path / f"pack_{recipe.stem}_{nproc}"
    run_recipe(recipe, [f"output_dir={out}", f"model.name_or_path={weights}", "model.random_init=false",
                        "data.shuffle=false", f"train.max_steps={STEPS}", f"humanline.sync_every={K}",
                        f"humanline.log_eps_P={CLIP[0]}", f"humanline.log_eps_R={CLIP[1]}", "train.warmup_steps=0",
                        "humanline.reference=copy", "eval.every=null", "checkpoint.save_every=null",
                        "checkpoint.save_final=false", *overrides], nproc=nproc)
    return [row["loss"] for row in read_jsonl(out / "metrics.jsonl")]


def trl_run(kind, weights, tmp_path, *args, nproc=1, name="trl", k=K):
    """The humanline TRL trainer's report per rank: ``history`` (one row per update), ``calls`` (each sync call and
    the collectives during it), ``hooks`` (weight checksums where a sync could run) and ``restores`` (the sync
    state loaded on resume); the reference synced every ``k`` updates."""
    report = tmp_path / f"{name}_{kind}"
    run_torchrun(RUN, [report, "--trainer", kind, "--model", weights, "--steps", STEPS, "--sync-every", k,
                       "--clip", *CLIP, "--out", tmp_path / f"{name}_out", *args], nproc=nproc)
    return [json.loads((tmp_path / f"{report.name}.rank{r}.json").read_text()) for r in range(nproc)]


def max_diff(history, pack):
    assert len(history) == len(pack) == STEPS, (history, pack)
    return max(abs(row["loss"] - p) for row, p in zip(history, pack))


def check_equal(reports, pack, kind, k=K):
    """Equal within 1e-5, with the clip binding on >= 5% of tokens at some update and the sync on schedule (every
    ``k`` updates)."""
    history = reports[0]["history"]
    clipped = max(row["clipped_frac"] for row in history)
    print(f"{kind}: max clipped fraction {clipped:.3f}, max |loss - pack| {max_diff(history, pack):.2e}")
    assert clipped >= 0.05, history
    assert [row["synced"] for row in history] == [n % k == 0 for n in range(STEPS)], history
    assert max_diff(history, pack) <= 1e-5, (history, pack)
    for report in reports:
        assert [c["synced"] for c in report["calls"]] == [n % k == 0 for n in range(STEPS)]
        assert all(c["sync_collectives"] == 0 for c in report["calls"]), report["calls"]


def settings(tmp_path, **extra):
    """TrainingArguments for the in-process trainers: fp32, a constant learning rate, rows in order, no saving."""
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, per_device_eval_batch_size=4,
                learning_rate=1e-3, lr_scheduler_type="constant", report_to=[], bf16=False, logging_steps=1,
                save_strategy="no", disable_tqdm=True, seed=0, train_sampling_strategy="sequential")
    base.update(extra)
    return base


def humanline_keywords(extra: dict) -> dict:
    """The trainers' defaults here (a clip that binds, k = 2), unless ``extra`` gives them (``transform=None`` and
    ``schedule=None`` given are kept: the test passes them); with ``config_only`` neither is passed."""
    from hl_core.humanline import ClipTransform, SyncSchedule

    if extra.pop("config_only", False):
        return {}
    return {"transform": extra.pop("transform", ClipTransform(-0.05, 0.05)),
            "schedule": extra.pop("schedule", SyncSchedule(every=2))}


def dpo(weights, tmp_path, rows=8, config_class=None, **extra):
    """A humanline DPO trainer on the tiny pairs' token ids (``args=`` extra TrainingArguments, ``config_class``
    another config class, e.g. ``HumanlineDPOConfig``)."""
    from transformers import AutoTokenizer
    from trl import DPOConfig

    from distributed.trl_data import dpo_rows, load
    from hl_core.integrations.trl import HumanlineDPOTrainer

    tok = AutoTokenizer.from_pretrained(weights)
    data = dpo_rows(tok).select(range(rows))
    config = (config_class or DPOConfig)(**settings(tmp_path, **extra.pop("args", {})), beta=0.1, max_length=None)
    keywords = humanline_keywords(extra)
    return HumanlineDPOTrainer(load(weights), ref_model=load(weights), args=config, train_dataset=data,
                               eval_dataset=data, processing_class=tok, **keywords, **extra)


def kto(weights, tmp_path, config_class=None, **extra):
    """A humanline KTO trainer on the tiny pairs as KTO examples, with the pack's mismatched completions."""
    from transformers import AutoTokenizer
    from trl import KTOConfig

    from distributed.trl_data import kto_rows, load
    from hl_core.integrations.trl import HumanlineKTOTrainer

    tok = AutoTokenizer.from_pretrained(weights)
    data = kto_rows(tok, 8).select(range(16))
    config = (config_class or KTOConfig)(**settings(tmp_path, per_device_train_batch_size=8,
                                                    per_device_eval_batch_size=8, **extra.pop("args", {})),
                                         beta=0.1, max_length=None)
    keywords = humanline_keywords(extra)
    return HumanlineKTOTrainer(load(weights), ref_model=load(weights), args=config, train_dataset=data,
                               eval_dataset=data, processing_class=tok, **keywords, **extra)


def grpo(weights, tmp_path, model=None, config_class=None, **extra):
    """A humanline GRPO trainer on the tiny offline groups (4 completions each, 2 groups per update)."""
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    from distributed.trl_data import grpo_rows, load
    from hl_core.integrations.trl import HumanlineGRPOTrainer

    tok = AutoTokenizer.from_pretrained(weights)
    config = (config_class or GRPOConfig)(**{"beta": 0.0, "loss_type": "bnpo", "num_generations": 4,
                                             "temperature": 1.0,
                                             **settings(tmp_path, per_device_train_batch_size=8,
                                                        **extra.pop("args", {}))})
    keywords = humanline_keywords(extra)
    return HumanlineGRPOTrainer(model if model is not None else load(weights), reward_funcs=[], args=config,
                                train_dataset=grpo_rows(tok).select(range(16)), processing_class=tok, **keywords,
                                **extra)


def checksum(model):
    return sum(float(p.detach().double().sum()) for p in model.parameters())


def conversational(kind):
    """TRL's conversational rows from the tiny pairs: preference (DPO) or unpaired (KTO, chosen then rejected)."""
    from datasets import Dataset

    rows = [json.loads(line) for line in (REPO / "tests/fixtures/tiny/prefs/train.jsonl").read_text().splitlines()]
    if kind == "dpo":
        return Dataset.from_list([{"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:],
                                   "rejected": r["rejected"][-1:]} for r in rows[:64]])
    return Dataset.from_list([{"prompt": r[side][:-1], "completion": r[side][-1:], "label": side == "chosen"}
                              for r in rows[:64] for side in ("chosen", "rejected")])


def recorded(trainer):
    """``trainer.compute_loss`` recording each training micro-batch's loss (a list that fills as it trains)."""
    seen, compute_loss = [], trainer.compute_loss

    def record(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        if trainer.model.training:
            seen.append(float(loss.detach()))
        return loss

    trainer.compute_loss = record
    return seen
