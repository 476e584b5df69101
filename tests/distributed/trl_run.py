"""Train with a humanline TRL trainer (``hl_core.integrations.trl``) on the tiny fixtures' token ids, as the pack
tokenizes them, and write what happened to ``REPORT.rank<r>.json``: one row per update (``update``, ``loss``,
``clipped_frac``, ``synced``) and, per sync call, the collectives that ran during it.

usage: trl_run.py REPORT --trainer dpo|kto|grpo --model DIR [--zero 3] [--late] [--save-steps N] [--resume DIR]
[...]

``--late`` moves the sync to TRL's ``on_step_end`` (after the optimizer step: the post-update weights), the timing
the comparison must reject. ``--save-steps N`` writes TRL's checkpoints (with the humanline files) every N updates;
``--resume DIR`` trains with ``resume_from_checkpoint=DIR``, and the report's ``restores`` has, per
``ReferenceSync.load_state_dict`` call, the collectives during it and the checksum of this rank's reference
(ZeRO-3: its partitions) after it. Each update's row in ``hooks`` has ``ref_begin``, the same checksum at its
start."""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import TrainerCallback

sys.path.insert(0, str(Path(__file__).resolve().parent))
warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")
if "--zero" in sys.argv and not torch.cuda.is_available():  # CPU ranks under DeepSpeed: gloo's collectives, and no
    import deepspeed.ops  # JIT-compiled shared-memory all-reduce (g++ and ninja, minutes; examples/_launch.py)

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False

from sync_harness import CountCollectives  # noqa: E402
from trl_data import build  # noqa: E402

from hl_core.humanline import ClipTransform, ReferenceSync, SampleTransform, SyncSchedule  # noqa: E402
from hl_core.integrations.trl import HumanlineSyncCallback  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("report")
parser.add_argument("--trainer", choices=["dpo", "kto", "grpo"], default="dpo")
parser.add_argument("--model", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--sync-every", type=int, default=2)
parser.add_argument("--clip", type=float, nargs=2, default=(-0.05, 0.05))
parser.add_argument("--zero", type=int, default=None)
parser.add_argument("--persist-below", type=int, default=1000)
parser.add_argument("--late", action="store_true")
parser.add_argument("--out", default=None)
parser.add_argument("--sample", action="store_true", help="humanline sampling (SampleTransform, seed 0)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--lora-seed", type=int, default=None, help="a LoRA policy, its adapter seeded as the pack's")
parser.add_argument("--save-steps", type=int, default=None)
parser.add_argument("--resume", default=None)
parser.add_argument("--batch", type=int, default=None, help="rows per process per update (default: the trainer's)")
parser.add_argument("--expect-refusal", action="store_true",
                    help="the resume is to be refused: write the refusal (a UserError's message) to the report")
parser.add_argument("--initial-reference", action="store_true",
                    help="the control: resume without the checkpoint's reference shards (the initial reference)")
args = parser.parse_args()
rank = int(os.environ.get("RANK", "0"))

calls = []
original = ReferenceSync._run  # every sync, called by hand or attached


def comm_modules():
    """Where the collectives are looked up: torch's, and DeepSpeed's (its package and ``deepspeed.comm.comm``, which
    ZeRO-3's gathers call)."""
    import torch.distributed as dist

    modules = [dist]
    try:
        import deepspeed.comm
        import deepspeed.comm.comm

        modules += [deepspeed.comm, deepspeed.comm.comm]
    except ImportError:
        pass
    return modules


def counted(self, updates_done):
    import torch.distributed as dist

    modules = comm_modules()
    probe.mark("adapter_sync")  # the weights the sync copies (the callback's call, or the engine's attached one)
    with CountCollectives(modules) as counter:
        record = original(self, updates_done)
    calls.append({"update": updates_done, "synced": record.synced, "sync_collectives": counter.count})
    if dist.is_initialized() and not any(c.get("probe") for c in calls):  # the counter can see one
        with CountCollectives(modules) as barrier:
            dist.barrier()
        calls[-1]["probe"] = barrier.count
    return record


ReferenceSync._run = counted
restores = []
original_load = ReferenceSync.load_state_dict


def counted_load(self, state):
    """``load_state_dict``, counting its collectives; then this rank's reference checksum (a LoRA policy's: its
    ``ref`` adapter's tensors) and, under ZeRO-3, a gather probe."""
    with CountCollectives(comm_modules()) as counter:
        original_load(self, state)
    references = [reference for _, _, reference in self.pairs]
    restores.append({"collectives": counter.count, "ref_checksum": local_checksum(references)})
    partitioned = [p for p in references if getattr(p, "ds_status", None) is not None
                   and p.ds_status.name == "NOT_AVAILABLE"]
    if partitioned:  # the counter sees a ZeRO-3 gather when one runs
        import deepspeed

        with CountCollectives(comm_modules()) as gather:
            with deepspeed.zero.GatheredParameters(partitioned[:1]):
                pass
        restores[-1]["gather_probe"] = gather.count


ReferenceSync.load_state_dict = counted_load
if args.initial_reference:
    base_load = HumanlineSyncCallback._load
    HumanlineSyncCallback._load = lambda self, state: base_load(
        self, {key: value for key, value in state.items() if key != "reference_shards"})
if args.late:  # the sync after the optimizer step, at TRL's on_step_end
    HumanlineSyncCallback.on_pre_optimizer_step = lambda self, *a, **k: None
    HumanlineSyncCallback._attach_engine = lambda self, engine: None
    base_step_end = HumanlineSyncCallback.on_step_end

    def late_step_end(self, a, state, control, **kwargs):
        if self.sync is not None:
            self.records.append(self.sync.before_optimizer_step(state.global_step - 1))
        return base_step_end(self, a, state, control, **kwargs)

    HumanlineSyncCallback.on_step_end = late_step_end

deepspeed = None
if args.zero is not None:
    deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "gradient_clipping": "auto", "zero_optimization": {
                     "stage": args.zero, "stage3_param_persistence_threshold": args.persist_below}}


def local_checksum(model):
    """The sum of this rank's weights of ``model`` (a module, or a list of tensors; ZeRO-3: its partitions
    ``ds_tensor``; nothing gathered); None without a reference model (a LoRA policy's reference is its ``ref``
    adapter)."""
    if model is None:
        return None
    tensors = model.parameters() if isinstance(model, torch.nn.Module) else model
    return sum(float(getattr(p, "ds_tensor", p).detach().double().sum()) for p in tensors)


class HookProbe(TrainerCallback):
    """A checksum of this rank's policy weights (ZeRO-3: its partitions) at each point where a sync could run:
    the update's start and end, ``on_pre_optimizer_step``, the adapter's sync and every call of a torch step
    pre-hook on the optimizer that really steps (inside the DeepSpeed engine, if any)."""

    def __init__(self):
        self.rows = []

    def checksum(self):
        return local_checksum(trainer.model)

    def mark(self, key):
        if self.rows:
            self.rows[-1].setdefault(key, []).append(self.checksum())

    def on_train_begin(self, a, state, control, **kwargs):
        engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else None
        inner = engine.optimizer.optimizer if engine is not None else trainer.optimizer.optimizer
        inner.register_step_pre_hook(lambda *_: self.mark("torch_step_pre_hook"))

    def on_step_begin(self, a, state, control, **kwargs):
        self.rows.append({"begin": self.checksum(), "ref_begin": local_checksum(trainer.ref_model)})

    def on_pre_optimizer_step(self, a, state, control, **kwargs):
        self.mark("on_pre_optimizer_step")

    def on_step_end(self, a, state, control, **kwargs):
        self.mark("end")


probe = HookProbe()
transform = SampleTransform(seed=0) if args.sample else ClipTransform(*args.clip)
trainer = build(args.trainer, Path(args.model), args.steps, transform,
                SyncSchedule(every=args.sync_every), deepspeed=deepspeed, out=args.out, save_steps=args.save_steps,
                lr=args.lr, lora_seed=args.lora_seed, batch=args.batch)
trainer.add_callback(probe)
if args.expect_refusal:
    from hl_core.errors import UserError

    try:
        trainer.train(resume_from_checkpoint=args.resume)
        refusal = None
    except UserError as exc:
        refusal = str(exc)
    Path(f"{args.report}.rank{rank}.json").write_text(json.dumps({"refused": refusal}))
    sys.exit(0)
trainer.train(resume_from_checkpoint=args.resume)
Path(f"{args.report}.rank{rank}.json").write_text(json.dumps({"history": trainer.humanline_history, "calls": calls,
                                                              "hooks": probe.rows, "restores": restores}))
