"""The trainer's callback seam (``hl_core.callbacks``): a ``LoopCallback`` added through ``train.callbacks`` sees
its three events in order, each with its part of the ``CallbackContext`` (the reference sync's record before the
optimizer step, the metrics row after the update, the checkpoint directory on save) and one ``user_state`` for the
run; an event that returns a value is refused; a class that is no ``LoopCallback`` is refused by name. The
reference sync is the training step's, not the callbacks': it runs after the backward and before the callbacks'
``before_optimizer_step``, the optimizer step after them, and ``CallbackList`` only fans events out."""

import json
from pathlib import Path

from helpers import TINY_HUMANLINE, run_recipe
from hl_core.callbacks import CallbackContext, CallbackList, LoopCallback
from hl_core.humanline import SyncRecord

STEPS, K = 4, 2


def _overrides(tmp_path, callback):
    return [f"output_dir={tmp_path / 'run'}", f"train.max_steps={STEPS}", f"humanline.sync_every={K}",
            "checkpoint.save_every=2", "checkpoint.save_final=false", "eval.every=null",
            f"train.callbacks=[{callback}]"]


def test_events_fire_in_order_with_their_context(tmp_path):
    events = tmp_path / "events.json"
    run_recipe(TINY_HUMANLINE, _overrides(tmp_path, f"{{path: run_callbacks:RecordEvents, args: {{path: {events}}}}}"))
    got = json.loads(events.read_text())
    kinds = [e["event"] for e in got]
    expected = []
    for n in range(STEPS):
        expected += ["before_optimizer_step", "after_update"] + (["on_save"] if (n + 1) % 2 == 0 else [])
    assert kinds == expected, kinds
    before = [e for e in got if e["event"] == "before_optimizer_step"]
    assert [e["updates_done"] for e in before] == list(range(STEPS))
    assert [e["synced"] for e in before] == [n % K == 0 for n in range(STEPS)]  # the reference synced first
    assert not any(e["row"] for e in before)
    after = [e for e in got if e["event"] == "after_update"]
    expected_after = [(n + 1, n, n % K == 0) for n in range(STEPS)]
    assert [(e["updates_done"], e["step"], e["synced"]) for e in after] == expected_after
    saves = [e for e in got if e["event"] == "on_save"]
    assert [e["updates_done"] for e in saves] == [2, 4] and all(e["files"] for e in saves)
    assert saves[0]["checkpoint"] != saves[1]["checkpoint"]


def test_an_event_that_returns_a_value_is_refused(tmp_path):
    proc = run_recipe(TINY_HUMANLINE, _overrides(tmp_path, "run_callbacks:ReturnsAValue"), expect=1)
    assert "ReturnsAValue.after_update returned a value: callback events return nothing" in proc.stdout + proc.stderr


def test_a_callback_of_another_kind_is_refused(tmp_path):
    proc = run_recipe(TINY_HUMANLINE, _overrides(tmp_path, "builtins:dict"), expect=2)
    assert "not a LoopCallback" in proc.stdout + proc.stderr


def test_the_step_syncs_then_tells_the_callbacks_then_steps(tmp_path):
    """With a reference copy: at a synced update the callbacks see the reference equal to the policy (the sync ran
    before them, the optimizer step after them); at the others, the policy has moved away from it. Were the sync
    after the callbacks, or the step before them, the synced updates would show a gap too."""
    events = tmp_path / "events.json"
    overrides = _overrides(tmp_path, f"{{path: run_callbacks:RecordEvents, args: {{path: {events}}}}}")
    run_recipe(TINY_HUMANLINE, [*overrides, "humanline.reference=copy"])
    before = [e for e in json.loads(events.read_text()) if e["event"] == "before_optimizer_step"]
    assert [e["synced"] for e in before] == [n % K == 0 for n in range(STEPS)]
    assert all(e["gap"] == 0.0 for e in before if e["synced"]), before
    assert all(e["gap"] > 1e-6 for e in before if not e["synced"]), before


def test_the_callback_list_fans_out_what_the_step_did():
    """``CallbackList.before_optimizer_step`` hands each callback the sync's record it is given; it runs no sync."""
    seen = []

    class Sees(LoopCallback):
        def before_optimizer_step(self, ctx):
            seen.append(ctx.sync)

    record = SyncRecord(True, 0.25, 64)
    ctx = CallbackContext(3, engine=None, output_dir=Path("."))
    assert CallbackList([Sees(), Sees()]).before_optimizer_step(ctx, record) is None
    assert seen == [record, record] and ctx.sync is record
