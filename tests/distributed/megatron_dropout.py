"""Run under torchrun (2 processes, pp=2, dropout on): the two-pass pipeline backward recomputes the
policy forward under the RNG state of the first pass, so it sees the same dropout masks.

Records, on the last stage, the log-probs of every pipeline micro-batch; per update it compares the
forward-only pass (what the trainer's loss used) with the recomputation inside ``backward``. As a
control, one more update runs with the RNG restore disabled. The last stage (rank 1) writes a JSON
report to argv[1].
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import hl_core.engines.megatron_logps as megatron_logps  # noqa: E402
from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
report_path, out_dir = sys.argv[1], sys.argv[2]
recipe = load_recipe(REPO / "recipes/tiny/megatron_tp1_pp2_humanline_dpo.yaml", [
    "model.config_overrides={attention_dropout: 0.3}", "train.max_steps=3", "eval.every=null",
    "humanline.reference=copy",  # the reference model's forward pieces are what this script compares
    "checkpoint.save_every=null", "checkpoint.save_final=false", "checkpoint.resume=never",
    f"output_dir={out_dir}", "logging.progress_bar=false",
])
trainer = Trainer(recipe)
trainer.setup()
engine = trainer.engine
seen = []
original = megatron_logps.vocab_parallel_token_logps


def recording(logits, input_ids, *args, **kwargs):
    out = original(logits, input_ids, *args, **kwargs)
    seen.append(out.detach().clone())
    return out


megatron_logps.vocab_parallel_token_logps = recording


def one_update():
    seen.clear()
    trainer.train_step()
    if not engine.last_stage:  # only the last stage computes log-probs
        return None
    pieces = len(seen) // 3
    # per update: policy forward-only pieces, reference pieces, then the recomputed policy pieces
    first, recomputed = torch.cat(seen[:pieces]), torch.cat(seen[2 * pieces : 3 * pieces])
    reference = torch.cat(seen[pieces : 2 * pieces])
    return {"recompute_diff": (first - recomputed).abs().max().item(),
            "policy_vs_reference": (first - reference).abs().max().item(), "pieces": pieces}


results = [one_update() for _ in range(2)]
engine._set_rng_state = lambda state: None  # control: no restore
control = one_update()
if engine.last_stage:
    Path(report_path).write_text(json.dumps({"updates": results, "control": control}))
trainer.close()
