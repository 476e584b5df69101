"""The trainer's callback seam (``hl_core.callbacks``): a ``LoopCallback`` added through ``train.callbacks`` sees
its three events in order, each with its part of the ``CallbackContext`` (the reference sync's record before the
optimizer step, the metrics row after the update, the checkpoint directory on save) and one ``user_state`` for the
run; an event that returns a value is refused; a class that is no ``LoopCallback`` is refused by name."""

import json

from helpers import TINY_HUMANLINE, run_recipe

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
