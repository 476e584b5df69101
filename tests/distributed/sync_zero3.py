"""Run under torchrun (2 processes): humanline syncing under ZeRO-3, checked against gathered weights.

argv: report.json output_dir sync_every [overrides...]. Writes a JSON report (rank 0) to argv[1]. Gathering
happens only here, in the test harness.
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_harness import CountCollectives, record_sync_steps  # noqa: E402

from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
report_path, out_dir, sync_every = sys.argv[1], sys.argv[2], int(sys.argv[3])
extra = sys.argv[4:]  # more overrides (e.g. `humanline.sync_mix=0.5`, fewer updates)

recipe = load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", [
    "engine.zero_stage=3",
    # small threshold: norms (64 elements) stay whole on every rank (ds_persist), matrices are partitioned
    "engine.zero3_param_persistence_threshold=100",
    f"humanline.sync_every={sync_every}", "humanline.reference=copy", f"output_dir={out_dir}", "eval.every=null",
    "checkpoint.save_every=null", "checkpoint.save_final=false", "logging.progress_bar=false",
    "train.max_steps=5", "train.lr=5e-3", *extra,
])
trainer = Trainer(recipe)
trainer.setup()
engine = trainer.engine


def gather(module):
    """Full weights as the next forward would see them, without disturbing ZeRO-3's state: a parameter
    held whole (persistent) is read as is; only partitioned ones are gathered (and released again)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    held = {id(p) for p in module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE}
    partitioned = [p for p in module.parameters() if id(p) not in held]
    with deepspeed.zero.GatheredParameters(partitioned):
        return {name: p.detach().clone().float() for name, p in module.named_parameters()}


persistent = []
for _, pol, ref in engine.reference_pairs():
    if getattr(pol, "ds_persist", False) and pol.ds_numel <= 100:
        persistent.append(True)

# The counter must be able to see a gather: count one deliberately.
with CountCollectives((dist, deepspeed.comm)) as probe:
    gather(engine.reference.module)
gather_calls_seen_by_probe = probe.count

records = record_sync_steps(trainer, engine, lambda: gather(engine.policy.module),
                            lambda: gather(engine.reference.module), modules=(dist, deepspeed.comm))
trainer.train()
rank = dist.get_rank()
if rank == 0:
    Path(report_path).write_text(json.dumps({
        "records": records, "probe_gather_calls": gather_calls_seen_by_probe,
        "num_persistent": sum(persistent), "num_params": len(engine.reference_pairs()),
        "metrics": [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()],
    }))
trainer.close()
