"""Run under torchrun (2 processes): humanline syncing on the megatron engine, checked against gathered weights.

argv: report.json output_dir recipe sync_every [overrides...]. Runs the trainer; around every
optimizer update it records (rank 0) whether the reference equals the policy's pre-update weights,
whether the reference stayed put between syncs, and how many collectives the sync itself issued.
Gathering (full weights under HF names) happens only here, in the test harness.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_harness import CountCollectives, record_sync_steps  # noqa: E402

from hl_core.config import load_recipe  # noqa: E402
from hl_core.engines.megatron_convert import mcore_to_hf  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

report_path, out_dir, recipe_path, sync_every = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
recipe = load_recipe(recipe_path, [
    f"humanline.sync_every={sync_every}", "humanline.reference=copy", f"output_dir={out_dir}",
    "logging.progress_bar=false",
    *sys.argv[5:],
])
trainer = Trainer(recipe)
trainer.setup()
engine = trainer.engine


def gather(module):
    """Full weights (HF names, float32) from every rank's shard of ``module``."""
    local = ((engine.pp_rank, engine.tp_rank), {n: p.detach().float().clone() for n, p in module.named_parameters()})
    items = [None] * dist.get_world_size()
    dist.all_gather_object(items, local)
    return mcore_to_hf(dict(items), engine.hf_config, engine.tp, engine.pp)


with CountCollectives() as probe:  # the counter must be able to see a gather
    gather(engine.reference)
probe_calls = probe.count

records = record_sync_steps(trainer, engine, lambda: gather(engine.policy_module), lambda: gather(engine.reference))
trainer.train()
if dist.get_rank() == 0:
    Path(report_path).write_text(json.dumps({
        "records": records, "probe_calls": probe_calls, "tp": engine.tp, "pp": engine.pp,
        "metrics": [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()],
    }))
trainer.close()
