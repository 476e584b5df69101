"""``ReferenceSync``'s state and how it is driven: ``state_dict`` / ``load_state_dict`` carry the update count, the
syncs done, the schedule and this rank's reference shards (through ``torch.save`` / ``torch.load(weights_only=True)``);
a changed schedule or another layout is refused; ``attach`` and manual calls never mix; ``attach`` refuses what it
cannot hook. The loops that resume with it: tests/test_resume_own_loop.py."""

import pytest
import torch

from hl_core.humanline import ReferenceSync, SyncSchedule, SyncUsageError, pair_parameters


def _models(width=3):
    torch.manual_seed(0)
    return (torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2)),
            torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2)))


def test_state_round_trips_through_a_weights_only_file(tmp_path):
    policy, reference = _models()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=3, offset=1, mix=0.5))
    for n in range(5):
        sync.before_optimizer_step(n)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.1)
    torch.save(sync.state_dict(), tmp_path / "sync.pt")
    saved_ref = [r.detach().clone() for r in reference.parameters()]

    policy2, reference2 = _models()
    fresh = ReferenceSync(pair_parameters(policy2, reference2), SyncSchedule(every=3, offset=1, mix=0.5))
    fresh.load_state_dict(torch.load(tmp_path / "sync.pt", weights_only=True))
    assert (fresh.updates_seen, fresh.num_syncs) == (5, 2)
    assert all(torch.equal(r, s) for r, s in zip(reference2.parameters(), saved_ref))
    assert not all(torch.equal(r, s) for r, s in zip(reference2.parameters(), _models()[1].parameters()))


def test_a_changed_schedule_or_layout_is_refused():
    policy, reference = _models()
    state = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=3)).state_dict()
    other = ReferenceSync(pair_parameters(*_models()), SyncSchedule(every=2))
    with pytest.raises(ValueError, match=r"SyncSchedule\(every=3, offset=0, mix=1.0\)"):
        other.load_state_dict(state)
    wider = ReferenceSync(pair_parameters(*_models(width=5)), SyncSchedule(every=3))
    with pytest.raises(ValueError, match="restore on the layout that saved them"):
        wider.load_state_dict(state)


def test_attach_and_manual_calls_never_mix():
    policy, reference = _models()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=1))
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    handle = sync.attach(optimizer)
    with pytest.raises(SyncUsageError, match="sync twice"):
        sync.before_optimizer_step(0)
    with pytest.raises(SyncUsageError, match="already attached"):
        sync.attach(optimizer)
    policy(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert (sync.updates_seen, sync.num_syncs) == (1, 1)  # one sync for the update, not two
    handle.remove()
    optimizer.step()
    assert sync.num_syncs == 1  # detached
    assert sync.before_optimizer_step(1).synced  # manual calls are allowed again
    with pytest.raises(SyncUsageError, match="called by hand"):
        sync.attach(optimizer)
    with pytest.raises(TypeError, match="torch optimizer, a DeepSpeed engine or a Megatron-core optimizer"):
        ReferenceSync(pair_parameters(*_models())).attach(policy)
