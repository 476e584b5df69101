"""One process (plain python or torchrun): the tiny humanline DPO recipe with LoRA on the real DeepSpeed engine,
first with a synced reference (k = 1), then with a frozen one (no syncing). Writes a JSON report to argv[1].

Synced: per update n, the bytes each sync copied, the reference adapter against the policy adapter right before
the optimizer step (theta_n), and the reference log-probs at update n + 1 against the policy's log-probs taken at
that moment. Then `final/` is loaded with PEFT (and `final/merged/` with transformers) and compared with the policy.
Frozen: the reference log-probs against the base model's, before and after training; the losses.
Resume: the synced run for 6 updates in one go, and stopped after 3 then resumed from its checkpoint.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.config import load_recipe  # noqa: E402
from hl_core.models.loading import build_causal_lm  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
report_path, out_root = Path(sys.argv[1]), Path(sys.argv[2])
COMMON = ["eval.every=null", "checkpoint.save_every=null", "logging.progress_bar=false"]


def probe_batch(vocab: int):
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, vocab, (2, 24), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@torch.no_grad()
def logps(engine, batch, model):
    return engine.token_logps(batch, model).detach().clone()


def base_logps(recipe, batch):
    base = build_causal_lm(recipe.model, recipe.engine.precision, recipe.train.seed)
    with torch.no_grad():
        logits = base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0], base


def shifted(token_logps):
    return token_logps[:, 1:]  # the engine's log-probs are aligned with input_ids (position 0 is masked)


def synced_run(report):
    recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo_lora.yaml", [
        *COMMON, f"output_dir={out_root / 'synced'}", "train.max_steps=12", "humanline.sync_every=1",
        "humanline.reference=copy"])  # the adapter copy (offline data would otherwise sync by look-ahead)
    trainer = Trainer(recipe)
    trainer.setup()
    engine = trainer.engine
    batch = probe_batch(engine.policy.module.config.vocab_size)
    lora = engine.lora
    optimized = {id(p) for group in engine._torch_optimizer.param_groups for p in group["params"]}
    report.update(
        reference_engine=engine.reference is not None, has_reference=engine.has_reference,
        adapter_bytes=lora.adapter_bytes, pairs=len(lora.pairs),
        model_bytes=sum(p.numel() * p.element_size() for p in engine.policy.module.parameters()),
        optimizer_is_policy_adapter=optimized == {id(p) for p in lora.policy_params},
        reference_trainable=any(r.requires_grad for _, _, r in lora.pairs),
    )
    records, pending = [], {}
    original_step, original_sync = engine.step, trainer.reference.before_optimizer_step

    def sync(updates_done):
        record = original_sync(updates_done)
        pending["sync_bytes"] = record.bytes
        return record

    def step():
        boundary = engine.is_accumulation_boundary()
        if boundary:  # after backward and the sync, before the optimizer: theta_n
            pending["ref_vs_policy"] = max((r - p).abs().max().item() for _, p, r in lora.pairs)
            pending["policy_logps"] = logps(engine, batch, "policy")
            pending["reference_grads"] = any(r.grad is not None for _, _, r in lora.pairs)
        out = original_step()
        if boundary:
            # the next update's reference (k = 1: theta_n) against the policy's log-probs at theta_n
            ref_next = logps(engine, batch, "reference")
            records.append(dict(sync_bytes=pending.pop("sync_bytes", 0), ref_vs_policy=pending["ref_vs_policy"],
                                reference_grads=pending["reference_grads"],
                                next_ref_vs_pre_policy=(ref_next - pending["policy_logps"]).abs().max().item(),
                                policy_moved=(logps(engine, batch,
                                                    "policy") - pending["policy_logps"]).abs().max().item()))
        return out

    engine.step, trainer.reference.before_optimizer_step = step, sync
    trainer.train()
    final_policy = logps(engine, batch, "policy")
    trainer.close(destroy_process_group=False)
    report["records"] = records
    rows = [json.loads(line) for line in (out_root / "synced" / "metrics.jsonl").read_text().splitlines()]
    report["synced_losses"] = [r["loss"] for r in rows]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = out_root / "synced" / "final"
    report["final_files"] = sorted(p.name for p in final.iterdir())
    _, base = base_logps(recipe, batch)
    loaded = PeftModel.from_pretrained(base, str(final)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(final / "merged")).eval()
    expected = shifted(final_policy)
    for name, model in (("peft", loaded), ("merged", merged)):
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        got = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        report[f"final_{name}_vs_policy"] = (got - expected).abs().max().item()


def frozen_run(report):
    recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo_lora.yaml", [
        *COMMON, f"output_dir={out_root / 'frozen'}", "train.max_steps=16", "humanline.sync_every=null",
        "checkpoint.save_final=false"])
    trainer = Trainer(recipe)
    trainer.setup()
    engine = trainer.engine
    batch = probe_batch(engine.policy.module.config.vocab_size)
    expected, base = base_logps(recipe, batch)
    base_params = sum(p.numel() for p in base.parameters())
    before = shifted(logps(engine, batch, "reference"))
    trainer.train()
    after = shifted(logps(engine, batch, "reference"))
    policy = shifted(logps(engine, batch, "policy"))
    report.update(
        frozen_reference_engine=engine.reference is not None, frozen_has_reference=engine.has_reference,
        frozen_pairs=len(engine.lora.pairs),
        frozen_extra_params=sum(p.numel() for p in engine.policy.module.parameters()) - base_params,
        frozen_adapter_params=sum(p.numel() for p in engine.lora.policy_params),
        frozen_ref_vs_base_before=(before - expected).abs().max().item(),
        frozen_ref_vs_base_after=(after - expected).abs().max().item(),
        frozen_policy_vs_base_after=(policy - expected).abs().max().item(),
    )
    trainer.close(destroy_process_group=False)
    rows = [json.loads(line) for line in (out_root / "frozen" / "metrics.jsonl").read_text().splitlines()]
    report["frozen_losses"] = [r["loss"] for r in rows]


def resume_runs(report):
    """Synced LoRA: 6 updates in one go, and 3 + 3 with a checkpoint between (resumed by `checkpoint.resume: auto`)."""
    common = [*COMMON[:1], "logging.progress_bar=false", "train.max_steps=6", "checkpoint.save_final=false",
              "humanline.reference=copy"]
    runs = [("whole", ["checkpoint.save_every=null"]), ("split", ["checkpoint.save_every=3", "train.stop_after=3"]),
            ("split", ["checkpoint.save_every=3"])]
    for index, (name, extra) in enumerate(runs):
        recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo_lora.yaml",
                             [*common, *extra, f"output_dir={out_root / name}"])
        trainer = Trainer(recipe)
        trainer.setup()
        trainer.train()
        trainer.close(destroy_process_group=index == len(runs) - 1)
        if index == 1:
            ckpt = out_root / "split" / "checkpoints" / "step_3"
            report["resume_reference_files"] = sorted(p.name for p in ckpt.rglob("reference_rank*.pt"))
            report["resume_checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    for name in ("whole", "split"):
        rows = [json.loads(line) for line in (out_root / name / "metrics.jsonl").read_text().splitlines()]
        report[f"resume_{name}"] = [(r["step"], r["loss"]) for r in rows]


report = {}
synced_run(report)
frozen_run(report)
resume_runs(report)
report_path.write_text(json.dumps(report))
