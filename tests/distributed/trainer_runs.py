"""Run several short trainings in one process group (plain ``python``: one process, gloo) and report them.

argv: report.json then ``name|recipe|override,override,...`` entries. For each: the real ``Trainer`` (setup, train,
close), its metric rows, the reference mode and reason it chose, whether the engine holds a reference, and, when
the run syncs a reference it holds, a record per update of what the sync did (``sync_harness.record_sync_steps``:
the reference against the pre-update policy, the pre-sync reference and their soft update), read from the
reference model's parameters (ZeRO-0: whole on the rank) or from LoRA's reference adapter.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sync_harness import record_sync_steps  # noqa: E402

from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402
from launchers.in_process import destroy_process_group  # noqa: E402


def weights(engine, which: str):
    """Full float32 copies: the adapter tensors of a LoRA run (named by the reference adapter), else every
    parameter of the module (ZeRO-0: held whole)."""
    if engine.lora is not None:
        return {name: (p if which == "policy" else r).detach().float().clone() for name, p, r in engine.lora.pairs}
    module = engine.policy.module if which == "policy" else engine.reference.module
    return {name: p.detach().float().clone() for name, p in module.named_parameters()}


report = {}
for spec in sys.argv[2:]:
    name, recipe_path, overrides = spec.split("|")
    out = Path(sys.argv[1]).parent / name
    recipe = load_recipe(recipe_path, [o for o in overrides.split(",") if o] + [
        f"output_dir={out}", "logging.progress_bar=false", "checkpoint.save_every=null", "checkpoint.save_final=false",
        "eval.every=null"])
    trainer = Trainer(recipe)
    trainer.setup()
    engine = trainer.engine
    records = []
    if recipe.humanline.sync_every is not None and trainer.reference.mode == "copy":
        records = record_sync_steps(trainer, engine, lambda: weights(engine, "policy"),
                                    lambda: weights(engine, "reference"))
    trainer.train()
    report[name] = {
        "rows": [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()],
        "reference_mode": trainer.reference.mode, "reference_reason": trainer.reference.reason,
        "has_reference": engine.has_reference, "reference_model": engine.reference is not None,
        "max_steps": recipe.train.max_steps, "records": records,
    }
    trainer.close(destroy_process_group=False)
Path(sys.argv[1]).write_text(json.dumps(report))
destroy_process_group()  # with DeepSpeed's cached groups (the tests run this script in their process)
