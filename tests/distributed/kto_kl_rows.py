"""One process, real DeepSpeed engine: online KTO's KL rows and z0 (tests/test_kto_reference_rows.py).

For each shape (prompts per micro-batch, micro-batches per update) it builds a trainer on the tiny online
reward-model recipe with the KTO objective, generates the update's samples and reports, per KL row,
whether its completion was written for another prompt; then, after one update (policy != reference), z0
with one example weighted and the per-row KL sums computed here from the engine's log-probs.
Writes a JSON report to argv[1]; argv[2] is the output directory.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
report_path, out_dir = sys.argv[1], sys.argv[2]


def rows(input_ids, completion_mask, attention_mask):
    out = []
    for ids, comp, att in zip(input_ids.tolist(), completion_mask.tolist(), attention_mask.tolist()):
        out.append((tuple(t for t, c, a in zip(ids, comp, att) if a and not c),
                    tuple(t for t, c in zip(ids, comp) if c)))
    return out


def kl_rows_report(batches):
    pairs = [r for b in batches for r in rows(b["input_ids"], b["completion_mask"], b["attention_mask"])]
    report = []
    for b in batches:
        main = rows(b["input_ids"], b["completion_mask"], b["attention_mask"])
        kl = rows(b["kl_input_ids"], b["kl_completion_mask"], b["kl_attention_mask"])
        for (prompt, _), (kl_prompt, kl_completion) in zip(main, kl):
            others = {c for p, c in pairs if p != prompt}
            report.append({"same_prompt_tokens": kl_prompt == prompt, "other_prompts_completion": kl_completion
                           in others})
    return report


def shape(prompts_per_micro, micro_per_update, tag):
    recipe = load_recipe(REPO / "recipes/tiny/online_dpo_rm.yaml", [
        "objective={name: kto, beta: 0.1}", f"train.micro_batch_size={prompts_per_micro}",
        f"train.global_batch_size={prompts_per_micro * micro_per_update}", "rollout.threshold=0.0",
        f"output_dir={out_dir}/{tag}", "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false",
        "logging.progress_bar=false", "train.max_steps=2", "train.lr=5e-2", "humanline.sync_every=null",
    ])
    trainer = Trainer(recipe)
    trainer.setup()
    result = {"step0": None, "z0": None}
    trainer.source.before_step(0)
    batches = trainer.source.buffer[0]
    result["step0"] = kl_rows_report(batches)
    result["same_prompt_metric"] = [trainer._loss(b, train=False)[1].get("kto/kl_same_prompt_frac") for b in batches]
    trainer.train_step()
    trainer.source.before_step(1)
    batch = dict(trainer.source.buffer[1][0])
    engine = trainer.engine
    with torch.no_grad():
        kl = {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"]}
        d = engine.token_logps(kl, "policy") - engine.token_logps(kl, "reference")
        sums = (d * batch["kl_completion_mask"].to(d.dtype)).sum(-1)
    best = int(sums.argmax())
    batch["weights"] = torch.nn.functional.one_hot(torch.tensor(best), len(sums)).float()
    result["z0"] = {"kl_sums": sums.tolist(), "weighted_row": best,
                    "engine_z0": float(trainer._loss(batch, train=False)[1]["kto/z0"])}  # metrics are device tensors
    trainer.close(destroy_process_group=False)
    return result


report = {"one_prompt": shape(1, 2, "one"), "two_prompts": shape(2, 1, "two"), "alone": shape(1, 1, "alone")}
Path(report_path).write_text(json.dumps(report))
