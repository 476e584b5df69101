"""Run an example of ``examples/`` on this rank (under the tests' launcher: ``RANK`` set, so it runs here) with the
collectives counted during every ``ReferenceSync.before_optimizer_step``; write ``{synced, sync_collectives,
probe_calls}`` per sync call to ``REPORT.rank<r>.json``.

usage: own_loop_probe.py REPORT EXAMPLE [EXAMPLE ARGS...]"""

import json
import runpy
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_harness import CountCollectives  # noqa: E402

from hl_core.humanline import ReferenceSync  # noqa: E402

report, example, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
modules = [dist]
try:
    import deepspeed.comm

    modules.append(deepspeed.comm)
except ImportError:
    pass
calls, original = [], ReferenceSync._run  # every sync, called by hand or attached


def counted(self, updates_done):
    with CountCollectives(modules) as counter:
        record = original(self, updates_done)
    calls.append({"update": updates_done, "synced": record.synced, "sync_collectives": counter.count})
    if not any(c.get("probe") for c in calls):  # the counter must be able to see one: count a barrier once
        with CountCollectives(modules) as probe:
            dist.barrier()
        calls[-1]["probe"] = probe.count
    return record


ReferenceSync._run = counted
sys.path.insert(0, str(example.parent))
sys.argv = [str(example), *args]
rank = None
try:
    runpy.run_path(str(example), run_name="__main__")
finally:
    import os

    Path(f"{report}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(calls))
