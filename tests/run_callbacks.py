"""Trainer callbacks the tests add through ``train.callbacks`` (``hl_core.callbacks``), so that a test acts on
a run at a known state instead of racing its clock: a run pauses at an update, or hangs a checkpoint's save, and
says so in a file; the test acts (a signal, a kill), then lets it go on."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hl_core.callbacks import LoopCallback

WAIT_S = 300.0  # bound on every wait: a test that never lets go fails instead of hanging CI


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path} after {WAIT_S:.0f} s")
        time.sleep(0.02)


class PauseAfterUpdate(LoopCallback):
    """After update ``update`` (counted from 1: ``updates_done == update``), every rank writes
    ``<output_dir>/paused_<update>_rank<r>`` and waits for ``<output_dir>/go_<update>``."""

    def __init__(self, update: int):
        self.update = int(update)

    def after_update(self, ctx):
        if ctx.updates_done != self.update:
            return
        (ctx.output_dir / f"paused_{self.update}_rank{ctx.engine.rank}").write_text("")
        _wait_for(ctx.output_dir / f"go_{self.update}")


class HangBeforeComplete(LoopCallback):
    """The save of checkpoint ``tag`` hangs on rank 0 after every rank's files and before its completeness marker,
    after writing ``<checkpoint>/hanging`` (the test kills the run meanwhile)."""

    def __init__(self, tag: str):
        self.tag = tag

    def on_save(self, ctx):
        directory = ctx.checkpoint_dir
        if directory.name == self.tag and ctx.engine.rank == 0:
            (directory / "hanging").write_text("")
            _wait_for(directory / "never")


def pause_after(update: int) -> str:
    """The override that pauses a run after ``update``."""
    return f"train.callbacks=[{{path: run_callbacks:PauseAfterUpdate, args: {{update: {update}}}}}]"


def hang_before_complete(tag: str) -> str:
    """The override that hangs the save of checkpoint ``tag``."""
    return f"train.callbacks=[{{path: run_callbacks:HangBeforeComplete, args: {{tag: {tag}}}}}]"


class RecordEvents(LoopCallback):
    """Every event rank 0 sees, in order, with what its context holds, rewritten to ``path`` (JSON) after each."""

    def __init__(self, path: str):
        self.path = Path(path)

    def _record(self, ctx, **fields) -> None:
        if ctx.engine.rank != 0:
            return
        events = ctx.user_state.setdefault("events", [])  # user_state: one dict for the whole run
        events.append({"updates_done": ctx.updates_done, **fields})
        self.path.write_text(json.dumps(events))

    def before_optimizer_step(self, ctx):
        # a reference copy: how far it is from the policy now (0 when the sync ran and the optimizer has not)
        gap = (max(float((p.detach() - r.detach()).abs().max()) for _, p, r in ctx.engine.reference_pairs())
               if ctx.engine.reference is not None else None)
        self._record(ctx, event="before_optimizer_step", synced=ctx.sync.synced, row=ctx.row is not None, gap=gap)

    def after_update(self, ctx):
        self._record(ctx, event="after_update", step=ctx.row["step"], synced=ctx.row["synced"])

    def on_save(self, ctx):
        self._record(ctx, event="on_save", checkpoint=ctx.checkpoint_dir.name,
                     files=ctx.checkpoint_dir.is_dir() and any(ctx.checkpoint_dir.iterdir()))


class ReturnsAValue(LoopCallback):
    """A callback that returns something from an event (refused: events return nothing)."""

    def after_update(self, ctx):
        return {"loss": 0.0}
