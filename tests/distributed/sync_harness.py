"""Shared by the sync test scripts: count collective calls, and record what each optimizer step did to
the policy and the reference (via test-only full gathers supplied by the caller)."""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist

COLLECTIVES = ["all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "broadcast",
               "all_reduce", "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter",
               "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier"]


class CountCollectives:
    """Patch the collectives (and point-to-point calls) of ``modules`` to count calls while active."""

    def __init__(self, modules=(dist,)):
        self.modules, self.count, self.saved = modules, 0, []

    def __enter__(self):
        for module in self.modules:
            for name in COLLECTIVES:
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                self.saved.append((module, name, fn))

                def wrapper(*a, __fn=fn, **k):
                    self.count += 1
                    return __fn(*a, **k)

                setattr(module, name, wrapper)
        return self

    def __exit__(self, *exc):
        for module, name, fn in self.saved:
            setattr(module, name, fn)


def record_sync_steps(trainer, engine, gather_policy: Callable[[], Dict], gather_reference: Callable[[], Dict],
                      modules=(dist,)) -> List[dict]:
    """Wrap the trainer's reference sync (``trainer.reference.before_optimizer_step``) and ``engine.step``; returns the
    list the records are appended to: per update
    ``n``, whether it synced, the collectives issued during the sync, and max-abs differences of the
    reference against the pre-update policy / pre-sync reference / the soft update of the two (``torch.lerp`` of
    the gathered weights by ``humanline.sync_mix``), and how far the policy moved."""
    records: List[dict] = []
    pending: dict = {}
    mix = trainer.recipe.humanline.sync_mix
    original_hook, original_step = trainer.reference.before_optimizer_step, engine.step

    def hook(updates_done):
        pending["pre_policy"], pending["pre_ref"] = gather_policy(), gather_reference()
        with CountCollectives(modules) as counter:
            result = original_hook(updates_done)
        pending.update(n=updates_done, synced=result.synced, sync_collectives=counter.count)
        return result

    def step():
        boundary = engine.is_accumulation_boundary()
        out = original_step()
        if boundary:
            post_ref, post_policy = gather_reference(), gather_policy()
            pre_policy, pre_ref = pending["pre_policy"], pending["pre_ref"]
            records.append({
                "n": pending["n"], "synced": pending["synced"], "sync_collectives": pending["sync_collectives"],
                "ref_vs_pre_policy": max((post_ref[k] - pre_policy[k]).abs().max().item() for k in post_ref),
                "ref_vs_pre_ref": max((post_ref[k] - pre_ref[k]).abs().max().item() for k in post_ref),
                "ref_vs_mix": max((post_ref[k] - torch.lerp(pre_ref[k], pre_policy[k], mix)).abs().max().item()
                                  for k in post_ref),
                "policy_moved": max((post_policy[k] - pre_policy[k]).abs().max().item() for k in post_ref),
            })
        return out

    trainer.reference.before_optimizer_step = hook
    engine.step = step
    return records
