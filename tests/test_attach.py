"""``ReferenceSync.attach`` on a DeepSpeed engine (its ``step`` at the gradient-accumulation boundary) gives the
per-update losses and syncs of the manual call before ``engine.step()``, at ZeRO-2 and ZeRO-3 with gradient
accumulation 2, on 2 processes. And ``attach`` on a Megatron-core optimizer syncs before its ``step``, once per call
(a ``MegatronOptimizer`` subclass over a torch optimizer: megatron-core's own optimizers allocate CUDA tensors, so the
real ``get_megatron_optimizer`` is not built on CPU)."""

import json

import pytest
import torch

from helpers import REPO, run_torchrun
from hl_core.humanline import ReferenceSync, SyncSchedule, pair_parameters

WORKER = REPO / "tests" / "distributed" / "attach_deepspeed.py"


@pytest.mark.parametrize("zero", [2, 3])
def test_attach_on_a_deepspeed_engine_equals_the_manual_call(tmp_path, zero):
    run_torchrun(WORKER, [tmp_path / "report", "--zero", zero], nproc=2, timeout=900)
    for rank in range(2):
        report = json.loads((tmp_path / f"report.rank{rank}.json").read_text())
        manual, attached = report["manual"], report["attach"]
        assert manual["synced"] == [n % 2 == 0 for n in range(6)]
        assert attached["synced"] == manual["synced"]
        assert max(manual["clipped"]) > 0.05  # the clip binds: the reference's weights reach the loss
        gap = max(abs(a - m) for a, m in zip(attached["losses"], manual["losses"]))
        print(f"ZeRO-{zero} rank {rank}: max |attach - manual| {gap:.1e}")
        assert gap <= 1e-7, (attached, manual)


def test_attach_on_a_megatron_optimizer_syncs_before_its_step():
    megatron_optimizer = pytest.importorskip("megatron.core.optimizer")

    class TorchBacked(megatron_optimizer.MegatronOptimizer):
        """The smallest MegatronOptimizer: ``step`` is the inner torch optimizer's (where clipping would run)."""

        def __init__(self, inner):
            self.optimizer, self.steps = inner, []

        def step(self):
            self.steps.append([p.detach().clone() for p in self.optimizer.param_groups[0]["params"]])
            self.optimizer.step()
            return True, None, None

        zero_grad = get_loss_scale = reload_model_params = state_dict = load_state_dict = lambda *a, **k: None
        step_with_ready_grads = prepare_grads = sharded_state_dict = lambda *a, **k: None

    torch.manual_seed(0)
    policy, reference = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    optimizer = TorchBacked(torch.optim.SGD(policy.parameters(), lr=0.5))
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=2))
    handle = sync.attach(optimizer)
    for n in range(4):
        policy(torch.ones(1, 3)).sum().backward()
        ref_before = [r.detach().clone() for r in reference.parameters()]
        optimizer.step()
        expected = optimizer.steps[-1] if n % 2 == 0 else ref_before  # the weights the step started from
        assert all(torch.equal(r, e) for r, e in zip(reference.parameters(), expected)), n
    assert (sync.updates_seen, sync.num_syncs) == (4, 2)
    handle.remove()
    assert "step" not in vars(optimizer)  # the class's own step is back


def test_a_removed_attachment_under_a_newer_wrapper_stops_syncing_and_leaves_the_wrapper():
    """``attach`` wraps ``step`` as an ``hl_core.swaps`` layer: removing it while a newer wrapper (another swap) sits
    on top takes out the sync only; the newer wrapper keeps running, and undoing it restores the class's ``step``."""
    megatron_optimizer = pytest.importorskip("megatron.core.optimizer")
    from hl_core.swaps import swap

    class Counting(megatron_optimizer.MegatronOptimizer):
        def __init__(self):
            self.steps = 0

        def step(self):
            self.steps += 1

        zero_grad = get_loss_scale = reload_model_params = state_dict = load_state_dict = lambda *a, **k: None
        step_with_ready_grads = prepare_grads = sharded_state_dict = lambda *a, **k: None

    policy, reference = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    optimizer = Counting()
    sync = ReferenceSync(pair_parameters(policy, reference), SyncSchedule(every=1))
    handle = sync.attach(optimizer)
    below, calls = optimizer.step, []
    newer = swap(optimizer, "step", lambda: (calls.append("newer"), below())[1])
    optimizer.step()
    assert (sync.num_syncs, optimizer.steps, calls) == (1, 1, ["newer"])
    handle.remove()  # the newer wrapper stays on top; the sync under it is gone
    optimizer.step()
    assert (sync.num_syncs, optimizer.steps, calls) == (1, 2, ["newer", "newer"])
    assert sync.attach(optimizer) is not None  # removed, so it may attach again (on top of the newer wrapper)
    optimizer.step()
    assert (sync.num_syncs, optimizer.steps) == (2, 3)
    sync._attached.remove()
    newer.undo()
    assert "step" not in vars(optimizer)  # the class's own step is back
