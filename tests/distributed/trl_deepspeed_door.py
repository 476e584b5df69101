"""The resume door under DeepSpeed (ZeRO-2, one process, through accelerate), one scenario per process (accelerate
takes one DeepSpeed accelerator per process). A pickle planted in a file creates ``payload-ran-<file>`` when
unpickled. ``--mode``:

* ``planted``: a humanline DPO trainer writes checkpoint 2; then each of DeepSpeed's files in it (but
  ``zero_to_fp32.py``) in turn holds the payload and is resumed from: ``refused`` with the message, or not;
* ``script``: only ``zero_to_fp32.py`` holds it, which no resume reads: the run trains on;
* ``engine``: the model states hold it, with the adapter's check of the files bypassed, so that DeepSpeed's
  ``load_checkpoint`` reads it through the weights-only checkpoint engine the adapter installs;
* ``control``: the same with DeepSpeed's default checkpoint engine (the adapter's not installed).

Each mode writes ``REPORT.<mode>.json``: per case the outcome (``refused``, ``trained`` or ``failed``), the message
and which payloads ran.

usage: trl_deepspeed_door.py REPORT --model DIR --work DIR --mode planted|script|engine|control
"""

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")
if not torch.cuda.is_available():  # CPU ranks under DeepSpeed: gloo's collectives, no JIT-compiled shm op
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from trl_data import build  # noqa: E402

from hl_core.errors import UserError  # noqa: E402
from hl_core.humanline import ClipTransform, SyncSchedule  # noqa: E402
from hl_core.integrations.trl import checkpoint as ckpt, mixin  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("report")
parser.add_argument("--model", required=True)
parser.add_argument("--work", required=True)
parser.add_argument("--mode", choices=["planted", "script", "engine", "control"], required=True)
args = parser.parse_args()
work = Path(args.work)
ZERO2 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}


class Payload:
    """Unpickled, it creates ``payload-ran-<name>`` in the work folder."""

    def __init__(self, name):
        self.marker = str(work / f"payload-ran-{name.replace('/', '-')}")

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant(checkpoint, target, names):
    shutil.copytree(checkpoint, target)
    for name in names:
        torch.save({"state": Payload(name)}, target / name)
    return target


def trainer(out, steps):
    return build("dpo", Path(args.model), steps, ClipTransform(-0.05, 0.05), SyncSchedule(every=3), deepspeed=ZERO2,
                 out=str(work / out), save_steps=2)


def resume(trained, planted):
    """``refused`` with the message, ``trained``, or ``failed`` (another exception); and the payloads that ran."""
    try:
        trained.train(resume_from_checkpoint=str(planted))
        outcome = {"outcome": "trained"}
    except UserError as exc:
        outcome = {"outcome": "refused", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 (the control: DeepSpeed's own engine fails after unpickling)
        outcome = {"outcome": "failed", "message": f"{type(exc).__name__}: {exc}"[:300]}
    ran = sorted(p.name for p in work.glob("payload-ran-*"))
    for path in work.glob("payload-ran-*"):
        path.unlink()
    return {**outcome, "ran": ran}


checkpoint = work / "first" / "checkpoint-2"
if args.mode == "planted":
    first = trainer("first", 2)
    first.train()
files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*")
               if p.is_file() and (p.parent.name.startswith("global_step") or p.name in ("latest", "zero_to_fp32.py")))
states = next(name for name in files if name.endswith("model_states.pt"))
report = {"files": files}
if args.mode == "planted":
    report["planted"] = {name: resume(first, plant(checkpoint, work / f"planted{index}", [name]))
                         for index, name in enumerate(files) if name != "zero_to_fp32.py"}
elif args.mode == "script":
    report["script"] = resume(trainer("script_run", 3), plant(checkpoint, work / "script", ["zero_to_fp32.py"]))
else:
    ckpt.file_problems = lambda folder: []  # the adapter's check bypassed: DeepSpeed's load_checkpoint reads the file
    if args.mode == "control":
        mixin.ckpt.install_safe_engine = lambda engine: None  # DeepSpeed's default checkpoint engine
    report[args.mode] = resume(trainer(f"{args.mode}_run", 3), plant(checkpoint, work / args.mode, [states]))
Path(f"{args.report}.{args.mode}.json").write_text(json.dumps(report))
