"""The public sync on two processes, hooked onto a torch optimizer (``ReferenceSync.attach``): DDP and FSDP2
(DTensor shards), 4 updates with k = 2. Per update: whether it synced, the collectives during the sync, and the
reference (gathered outside the sync) against the policy's pre-step weights. usage: api_sync.py REPORT"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_harness import CountCollectives  # noqa: E402

from hl_core.humanline import ReferenceSync, SyncSchedule, pair_parameters  # noqa: E402

dist.init_process_group("gloo")
rank = dist.get_rank()


def build(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def whole(model):
    """Every parameter whole (a collective for DTensors: never inside a sync)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p
            in model.named_parameters()}


report = {}
for kind in ("ddp", "fsdp2"):
    policy, reference = build(kind), build(kind)
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.1)
    sync.attach(optimizer)
    records, gen = [], torch.Generator().manual_seed(rank)
    for n in range(4):
        policy(torch.randn(4, 8, generator=gen)).pow(2).sum().backward()
        before, ref_before = whole(policy), whole(reference)
        with CountCollectives() as counter:  # the whole step, the attached sync included
            optimizer.step()
        records.append({"n": n, "synced": sync.last_record.synced, "collectives": counter.count})
        optimizer.zero_grad()
        after, ref_after = whole(policy), whole(reference)
        records[-1].update(
            ref_vs_pre_policy=max((ref_after[k] - before[k]).abs().max().item() for k in before),
            ref_vs_pre_ref=max((ref_after[k] - ref_before[k]).abs().max().item() for k in before),
            policy_moved=max((after[k] - before[k]).abs().max().item() for k in before),
            local_shard=[list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape)
                         for p in policy.parameters()][0])
    with CountCollectives() as probe:
        dist.barrier()
    report[kind] = {"records": records, "probe": probe.count, "pairs": len(sync.pairs)}
Path(f"{sys.argv[1]}.rank{rank}.json").write_text(json.dumps(report))
dist.destroy_process_group()
