"""Run under torchrun (2 processes): the tiny humanline DPO recipe under ZeRO 0-3 x fp32/bf16 in one
process group. Writes per-configuration losses and the final/ directory of selected runs (rank 0)."""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
report_path, out_root = Path(sys.argv[1]), Path(sys.argv[2])
results = {}
rank = None
configs = [(stage, precision) for precision in ("fp32", "bf16") for stage in (0, 1, 2, 3)]
for index, (stage, precision) in enumerate(configs):
    name = f"zero{stage}_{precision}"
    save_final = precision == "fp32" and stage in (0, 3)
    recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [
        f"engine.zero_stage={stage}", f"engine.precision={precision}", f"output_dir={out_root / name}",
        "engine.zero3_param_persistence_threshold=100", "train.max_steps=4", "eval.every=null",
        "checkpoint.save_every=null", f"checkpoint.save_final={str(save_final).lower()}",
        "logging.progress_bar=false", "train.gradient_accumulation_steps=2", "train.micro_batch_size=4",
    ])
    trainer = Trainer(recipe)
    trainer.setup()
    rank = dist.get_rank()
    trainer.train()
    trainer.close(destroy_process_group=index == len(configs) - 1)
    if rank != 0:
        continue
    rows = [json.loads(line) for line in (out_root / name / "metrics.jsonl").read_text().splitlines()]
    results[name] = {"loss": [r["loss"] for r in rows], "grad_norm": [r["grad_norm"] for r in rows],
                     "synced": [r["synced"] for r in rows], "final": str(out_root / name / "final") if save_final
                     else None}
if rank == 0:
    report_path.write_text(json.dumps(results))
