"""``ReferenceSync.attach(engine)`` against the manual call before ``engine.step()`` on a DeepSpeed engine with
gradient accumulation 2: two runs of 6 updates (k = 2, clip bounds that bind) from the same weights and data, one per
way, on this rank's processes. Writes ``{mode: {"losses": [...], "synced": [...], "clipped": [...]}}`` to
``REPORT.rank<r>.json``. usage: attach_deepspeed.py REPORT --zero STAGE"""

import argparse
import json
from pathlib import Path

import deepspeed
import torch
import torch.nn.functional as F

from hl_core.humanline import ClipTransform, ReferenceSync, SyncSchedule, pair_parameters

parser = argparse.ArgumentParser()
parser.add_argument("report")
parser.add_argument("--zero", type=int, required=True)
args = parser.parse_args()
UPDATES, ACCUMULATION, ROWS, STEPS, VOCAB = 6, 2, 4, 5, 7

deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, VOCAB))


def engines():
    config = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": ACCUMULATION,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": args.zero,
                                                              "stage3_param_persistence_threshold": 20}}
    policy = model()
    policy, _, _, _ = deepspeed.initialize(model=policy, optimizer=torch.optim.AdamW(policy.parameters(), lr=0.05),
                                           config=config)
    # a reference without an optimizer: ZeRO-3 partitions it like the policy; below 3 every rank holds it whole
    ref_config = config if args.zero == 3 else {**config, "zero_optimization": {"stage": 0}}
    reference, _, _, _ = deepspeed.initialize(model=model().requires_grad_(False), config=ref_config)
    return policy, reference


def token_logps(engine, x, targets):
    return engine(x).log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)


def run(mode):
    policy, reference = engines()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    if mode == "attach":
        sync.attach(policy)
    clip, gen = ClipTransform(-0.02, 0.02), torch.Generator().manual_seed(100 + rank)
    out = {"losses": [], "synced": [], "clipped": []}
    for update in range(UPDATES):
        total, clipped, syncs_before = 0.0, 0.0, sync.num_syncs
        for _ in range(ACCUMULATION):
            x = torch.randn(ROWS, STEPS, 8, generator=gen)
            targets = torch.randint(0, VOCAB, (ROWS, STEPS), generator=gen)
            policy_logps = token_logps(policy, x, targets)
            with torch.no_grad():
                ref_logps = token_logps(reference, x, targets)
            log_ratios, metrics = clip(policy_logps, ref_logps, torch.ones(ROWS, STEPS))
            loss = -F.logsigmoid(log_ratios[:ROWS // 2].sum(-1) - log_ratios[ROWS // 2:].sum(-1)).mean()
            policy.backward(loss)
            if mode == "manual" and policy.is_gradient_accumulation_boundary():
                sync.before_optimizer_step(update)
            policy.step()
            total, clipped = total + loss.item(), clipped + 1 - metrics["unclamped_frac"].item()
        out["losses"].append(total / ACCUMULATION)
        out["clipped"].append(clipped / ACCUMULATION)
        out["synced"].append(sync.num_syncs > syncs_before)
    return out


report = {mode: run(mode) for mode in ("manual", "attach")}
Path(f"{args.report}.rank{rank}.json").write_text(json.dumps(report))
torch.distributed.barrier()
