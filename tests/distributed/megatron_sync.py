"""Run under torchrun (2 processes): humanline syncing on the megatron engine, checked against gathered weights.

argv: report.json output_dir recipe sync_every [overrides...]. Runs the trainer; around every
optimizer update it records (rank 0) whether the reference equals the policy's pre-update weights,
whether the reference stayed put between syncs, and how many collectives the sync itself issued.
Gathering (full weights under HF names) happens only here, in the test harness.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.config import load_recipe  # noqa: E402
from hl_core.engines.megatron_convert import mcore_to_hf  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

report_path, out_dir, recipe_path, sync_every = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
recipe = load_recipe(recipe_path, [
    f"humanline.sync_every={sync_every}", f"output_dir={out_dir}", "logging.progress_bar=false", *sys.argv[5:],
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


COLLECTIVES = ["all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "broadcast",
               "all_reduce", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "send", "recv",
               "isend", "irecv", "batch_isend_irecv", "barrier"]


class CountCollectives:
    """Patch torch.distributed collectives and point-to-point calls to count them while active."""

    def __init__(self):
        self.count, self.saved = 0, []

    def __enter__(self):
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved.append((name, fn))

            def wrapper(*a, __fn=fn, **k):
                self.count += 1
                return __fn(*a, **k)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved:
            setattr(dist, name, fn)


with CountCollectives() as probe:  # the counter must be able to see a gather
    gather(engine.reference)
probe_calls = probe.count

records, pending = [], {}
original_hook, original_step = trainer.sync_hook.before_optimizer_step, engine.step


def hook(eng, updates_done):
    pending["pre_policy"], pending["pre_ref"] = gather(engine.policy_module), gather(engine.reference)
    with CountCollectives() as counter:
        result = original_hook(eng, updates_done)
    pending.update(n=updates_done, synced=result.synced, sync_collectives=counter.count)
    return result


def step():
    boundary = engine.is_accumulation_boundary()
    out = original_step()
    if boundary:
        post_ref, post_policy = gather(engine.reference), gather(engine.policy_module)
        pre_policy, pre_ref = pending["pre_policy"], pending["pre_ref"]
        records.append({
            "n": pending["n"], "synced": pending["synced"], "sync_collectives": pending["sync_collectives"],
            "ref_vs_pre_policy": max((post_ref[k] - pre_policy[k]).abs().max().item() for k in post_ref),
            "ref_vs_pre_ref": max((post_ref[k] - pre_ref[k]).abs().max().item() for k in post_ref),
            "policy_moved": max((post_policy[k] - pre_policy[k]).abs().max().item() for k in post_ref),
        })
    return out


trainer.sync_hook.before_optimizer_step = hook
engine.step = step
trainer.train()
if dist.get_rank() == 0:
    Path(report_path).write_text(json.dumps({
        "records": records, "probe_calls": probe_calls, "tp": engine.tp, "pp": engine.pp,
        "metrics": [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()],
    }))
trainer.close()
