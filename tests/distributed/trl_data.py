"""The humanline TRL trainers on the tiny fixtures, fed the token ids the pack's own data code produces (same
tokenization, truncation, order), configured to compute the pack's objective: fp32, AdamW as the pack's, a constant
learning rate, gradient clipping at 1.0, rows in file order."""

from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "tests" / "fixtures" / "tiny"
MAX_LENGTH, MAX_PROMPT_LENGTH, LR = 64, 32, 1e-3


def common_config(steps: int, batch: int, deepspeed=None, out=None, save_steps=None, lr=LR) -> dict:
    import tempfile

    saving = {"save_strategy": "steps", "save_steps": save_steps} if save_steps else {"save_strategy": "no"}
    return dict(output_dir=out or tempfile.mkdtemp(prefix="trl_run_"), per_device_train_batch_size=batch,
                max_steps=steps,
                learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
                weight_decay=0.0, max_grad_norm=1.0, logging_steps=1, report_to=[], **saving,
                train_sampling_strategy="sequential", seed=0, bf16=False, gradient_checkpointing=False,
                disable_tqdm=True, deepspeed=deepspeed, **cpu_deepspeed_state(deepspeed))


def cpu_deepspeed_state(deepspeed) -> dict:
    """Under DeepSpeed, accelerate 1.15 picks a process-group backend only for an accelerator device: on CPU it
    counts 1 process although DeepSpeed runs 2 (no data sharding, gathers fail). A state set up beforehand with
    ``backend="gloo"`` and used as configured counts them right (``use_configured_state``)."""
    import os

    if not deepspeed or torch.cuda.is_available():
        return {}
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    return {"accelerator_config": {"use_configured_state": True}}


def load(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")


def dpo_rows(tokenizer) -> Dataset:
    """``prompt_ids``, ``chosen_ids``, ``rejected_ids`` of the tiny pairs, as ``hl_core.data`` tokenizes them."""
    from hl_core.data import load_preference_records, tokenize_preference

    rows = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for record in load_preference_records(path=str(TINY / "prefs" / "train.jsonl")):
        pair = tokenize_preference(record, tokenizer, MAX_LENGTH, MAX_PROMPT_LENGTH)
        start = pair["chosen_completion_mask"].index(1)
        rows["prompt_ids"].append(pair["chosen_input_ids"][:start])
        rows["chosen_ids"].append(pair["chosen_input_ids"][start:])
        rows["rejected_ids"].append(pair["rejected_input_ids"][start:])
    return Dataset.from_dict(rows)


def kto_rows(tokenizer, per_update: int) -> Dataset:
    """The tiny pairs as KTO examples (each pair: its chosen, then its rejected completion), as ``hl_core.data``
    tokenizes them, with the pack's mismatched (KL) completion of each: ``collate_unpaired`` over each update's
    examples (one process, one micro-batch per update)."""
    from hl_core.data import load_unpaired_records, tokenize_unpaired
    from hl_core.data.unpaired import collate_unpaired

    features = [tokenize_unpaired(r, tokenizer, MAX_LENGTH, MAX_PROMPT_LENGTH)
                for r in load_unpaired_records(path=str(TINY / "prefs" / "train.jsonl"))]
    rows = {"prompt_ids": [], "completion_ids": [], "label": [], "KL_completion_ids": []}
    for start in range(0, len(features) - per_update + 1, per_update):
        update = features[start:start + per_update]
        batch = collate_unpaired(update, tokenizer.pad_token_id, rows=list(range(per_update)))
        for f, ids, mask in zip(update, batch["kl_input_ids"], batch["kl_completion_mask"]):
            rows["prompt_ids"].append(f["prompt_ids"])
            rows["completion_ids"].append(f["completion_ids"])
            rows["label"].append(bool(f["desirable"]))
            rows["KL_completion_ids"].append(ids[mask.bool()].tolist())
    return Dataset.from_dict(rows)


def grpo_rows(tokenizer) -> Dataset:
    """The tiny prompt groups (4 scored completions each) as ``hl_core.data`` tokenizes them: one row per
    completion, a group's rows consecutive."""
    from hl_core.data.grouped import identical_group, load_group_records, tokenize_group

    rows = {"prompt_ids": [], "completion_ids": [], "score": []}
    for record in load_group_records(path=str(TINY / "groups" / "train.jsonl")):
        group = tokenize_group(record, tokenizer, MAX_LENGTH, MAX_PROMPT_LENGTH)
        if identical_group(group):
            continue
        for ids, mask, score in zip(group["input_ids"], group["completion_mask"], group["scores"]):
            start = mask.index(1)
            rows["prompt_ids"].append(ids[:start])
            rows["completion_ids"].append(ids[start:])
            rows["score"].append(score)
    return Dataset.from_dict(rows)


def lora_policy(model_dir: Path, seed: int):
    """The tiny model with the adapter of ``recipes/tiny/humanline_dpo_lora.yaml``, initialised as the pack
    initialises it (``hl_core.engines.lora.wrap_lora`` with the recipe's ``train.seed``): a ``PeftModel`` with one
    adapter, ``default``."""
    from types import SimpleNamespace

    from hl_core.engines.lora import wrap_lora

    section = SimpleNamespace(r=8, alpha=16, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"])
    return wrap_lora(load(model_dir), section, synced=False, seed=seed).model


def build(kind: str, model_dir: Path, steps: int, transform, schedule, deepspeed=None, out=None, save_steps=None,
          lr=LR, lora_seed=None, batch=None):
    """A humanline TRL trainer of ``kind`` (a checkpoint every ``save_steps`` updates, if given); with
    ``lora_seed``, a LoRA policy (``lora_policy``) and no reference model (the trainer's reference is then the
    policy's ``ref`` adapter); ``batch``: rows per process per update (default: one process's whole update)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    lora = lora_seed is not None
    policy = lora_policy(model_dir, lora_seed) if lora else load(model_dir)
    options = (deepspeed, out, save_steps, lr)
    if kind == "dpo":
        from trl import DPOConfig

        from hl_core.integrations.trl import HumanlineDPOTrainer

        config = DPOConfig(**common_config(steps, batch or 8, *options), beta=0.1, max_length=None)
        return HumanlineDPOTrainer(policy, ref_model=None if lora else load(model_dir), args=config,
                                   train_dataset=dpo_rows(tokenizer), processing_class=tokenizer,
                                   transform=transform, schedule=schedule)
    if kind == "kto":
        from trl import KTOConfig

        from hl_core.integrations.trl import HumanlineKTOTrainer

        config = KTOConfig(**common_config(steps, batch or 16, *options), beta=0.1, max_length=None)
        return HumanlineKTOTrainer(policy, ref_model=None if lora else load(model_dir), args=config,
                                   train_dataset=kto_rows(tokenizer, 16), processing_class=tokenizer,
                                   transform=transform, schedule=schedule)
    if kind == "grpo":
        from trl import GRPOConfig

        from hl_core.integrations.trl import HumanlineGRPOTrainer

        config = GRPOConfig(**common_config(steps, batch or 8, *options), beta=0.0, epsilon=0.2,
                            loss_type="bnpo", num_generations=4, temperature=1.0)
        return HumanlineGRPOTrainer(policy, reward_funcs=unused_reward, args=config,
                                    train_dataset=grpo_rows(tokenizer), processing_class=tokenizer,
                                    transform=transform, schedule=schedule)
    raise ValueError(kind)


def unused_reward(completions, **kwargs):
    raise AssertionError("offline groups carry their scores: nothing is generated or scored")
