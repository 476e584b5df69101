"""The resume door under DeepSpeed (ZeRO-2, one process, through accelerate): a humanline DPO trainer writes
checkpoint 2, then DeepSpeed's own files in it are each replaced by a pickle whose loading would create a marker
file, and resumed from. Written to ``REPORT.json``:

* ``planted``: per DeepSpeed file, ``refused`` (the one-paragraph refusal) or ``trained`` (a file no resume reads),
  and whether the marker appeared;
* ``engine``: the same payload in the model states with the adapter's check of the files bypassed, so that
  DeepSpeed's ``load_checkpoint`` reads it: the weights-only checkpoint engine the adapter installs refuses it;
* ``control``: the same load with DeepSpeed's default checkpoint engine (the adapter's not installed) runs it.

usage: trl_deepspeed_door.py REPORT --model DIR --work DIR
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
args = parser.parse_args()
work = Path(args.work)
marker = work / "payload-ran"
ZERO2 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto", "zero_optimization": {"stage": 2}}


class Payload:
    def __reduce__(self):
        return (open, (str(marker), "w"))


def trainer(out, steps):
    return build("dpo", Path(args.model), steps, ClipTransform(-0.05, 0.05), SyncSchedule(every=3), deepspeed=ZERO2,
                 out=str(work / out), save_steps=2)


def resume(trained, planted):
    """``refused`` with the message, ``trained``, or ``failed`` (another exception); and whether the payload ran."""
    try:
        trained.train(resume_from_checkpoint=str(planted))
        outcome = {"outcome": "trained"}
    except UserError as exc:
        outcome = {"outcome": "refused", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 (the control: DeepSpeed's own engine fails after unpickling)
        outcome = {"outcome": "failed", "message": f"{type(exc).__name__}: {exc}"[:300]}
    outcome["ran"] = marker.exists()
    marker.unlink(missing_ok=True)
    return outcome


first = trainer("first", 2)
first.train()
checkpoint = work / "first" / "checkpoint-2"
deepspeed_files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*")
                         if p.is_file() and (p.parent.name.startswith("global_step") or p.name in ("latest",
                                                                                                     "zero_to_fp32.py")))
planted_outcomes = {}
for index, name in enumerate(deepspeed_files):
    planted = work / f"planted{index}"
    shutil.copytree(checkpoint, planted)
    torch.save({"state": Payload()}, planted / name)
    reader = first if name != "zero_to_fp32.py" else trainer(f"fresh{index}", 3)  # that one trains on: a new trainer
    planted_outcomes[name] = resume(reader, planted)

states = next(name for name in deepspeed_files if name.endswith("model_states.pt"))
planted = work / "engine"
shutil.copytree(checkpoint, planted)
torch.save({"state": Payload()}, planted / states)
ckpt.file_problems = lambda folder: []  # the adapter's check bypassed: DeepSpeed's load_checkpoint reads the file
engine_outcome = resume(trainer("engine_run", 3), planted)
mixin.ckpt.install_safe_engine = lambda engine: None  # the control: DeepSpeed's default engine
control_outcome = resume(trainer("control_run", 3), planted)
Path(args.report).write_text(json.dumps({"planted": planted_outcomes, "engine": engine_outcome,
                                         "control": control_outcome, "files": deepspeed_files}))
