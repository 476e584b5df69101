"""Section 7 of ``bench/gpu_check.py``: TRL's ``DPOTrainer`` on the same random-init model, preference rows,
micro-batch, accumulation, sequence length, learning rate and GPU as our DPO runs, measured the same way: real
tokens (chosen + rejected, prompt included) per second of whole optimizer updates after the warm-up updates, and
``torch.cuda.max_memory_allocated`` over the measured updates.

TRL's defaults otherwise (its chunked log-probs from the LM head, mixed precision with float32 weights under
``bf16=True``, its own reference copy, torch's fused AdamW on a GPU); ``use_liger_kernel=True`` adds Liger's
RMSNorm/RoPE/SwiGLU kernels (TRL keeps its own LM head). TRL tokenizes the rows' strings without a chat template
(ours applies the tokenizer's), so its sequences are a few tokens shorter: tokens/s counts each side's own tokens.
"""

from __future__ import annotations

import copy
import time

from bench.shapes import forward_flops_per_token, spec_of


def trl_dpo(run: dict) -> dict:
    """One TRL run (``run["trl"]``: model_dir, data, micro, accumulation, seq, warmup, steps, lr, liger, bf16)."""
    import torch
    import trl
    from datasets import load_dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    cfg = run["trl"]
    cuda = torch.cuda.is_available()
    clock = {"tokens": 0, "step_start": None, "steps": [], "tokens_per_update": []}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    class Timed(DPOTrainer):
        def training_step(self, model, inputs, *args, **kwargs):
            clock["tokens"] += int(inputs["attention_mask"].sum())
            return super().training_step(model, inputs, *args, **kwargs)

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda and state.global_step == cfg["warmup"]:
                torch.cuda.reset_peak_memory_stats()
            sync()
            clock["tokens"], clock["step_start"] = 0, time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            clock["steps"].append(time.perf_counter() - clock["step_start"])
            clock["tokens_per_update"].append(clock["tokens"])

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(cfg["model_dir"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(cfg["model_dir"])
    args = DPOConfig(
        output_dir=cfg["output_dir"], per_device_train_batch_size=cfg["micro"],
        gradient_accumulation_steps=cfg["accumulation"],
        max_length=cfg["seq"], learning_rate=cfg["lr"], lr_scheduler_type="constant", warmup_steps=0,
        max_steps=cfg["warmup"] + cfg["steps"], bf16=cfg["bf16"], logging_steps=1, report_to="none", save_strategy="no",
        seed=0, beta=0.1, use_liger_kernel=cfg["liger"], max_grad_norm=1.0, use_cpu=not cuda, dataloader_num_workers=0,
        optim="adamw_torch_fused" if cuda else "adamw_torch", disable_tqdm=True,
    )
    # the reference: a copy of the same random init (TRL would reload it from the model's name, and a config-only
    # directory has no weights to load)
    trainer = Timed(model=model, ref_model=copy.deepcopy(model), args=args,
                    train_dataset=load_dataset("json", data_files=cfg["data"], split="train"),
                    processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    measured = slice(cfg["warmup"], None)
    seconds, tokens = sum(clock["steps"][measured]), sum(clock["tokens_per_update"][measured])
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    # MFU as ours counts it (bench.shapes): the policy's forward + backward (3 forwards) and the reference's forward
    per_update = len(clock["steps"][measured]) or 1
    sequences = 2 * cfg["micro"] * cfg["accumulation"]
    mean_len = tokens / per_update / sequences
    flops_per_token = 4 * forward_flops_per_token(spec_of("llama3.2-1b", **cfg.get("spec", {})), mean_len)
    return {"engine": "trl", "objective": "dpo", "mean_seq_len": mean_len, "flops_per_token": flops_per_token,
            "liger": cfg["liger"], "precision": "bf16 (amp)" if cfg["bf16"] else "fp32",
            "updates_measured": len(clock["steps"][measured]), "step_time_s": seconds
            / max(1, len(clock["steps"][measured])),
            "tokens_per_update": tokens / max(1, len(clock["steps"][measured])), "tokens_per_s": tokens / seconds,
            "peak_gib": torch.cuda.max_memory_allocated() / 1024 ** 3 if cuda else None, "losses": losses,
            "trl": trl.__version__}
