"""A reference copy against the copy-free modes through the real trainer, in one process (or under torchrun, one
per rank). argv: report.json, then ``recipe|override,override,...`` specs. Each spec runs twice from the same
start, with ``humanline.reference=copy`` and without a copy (look-ahead syncing when the spec syncs, else
``train.cache_reference_logps=true``); rank 0 writes ``{spec: {"copy": rows, "free": rows, "copy_built": bool,
"free_built": bool, "free_mode": str, "stored_forwards": int}}`` (every metrics.jsonl and eval.jsonl row,
timing fields dropped) as JSON."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hl_core.reference.store as reference_store  # noqa: E402
from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

TIMING = ("step_time_s", "sync_time_s", "rollout_time_s", "train_time_s", "tokens_per_s")
SHORT = ["train.max_steps=5", "eval.every=2", "checkpoint.save_every=null", "checkpoint.save_final=false",
         "logging.progress_bar=false", "checkpoint.resume=never", "train.warmup_steps=0"]
FORWARDS = [0]  # forwards the policy ran in place of a reference (proof that the copy-free path ran)
_fill = reference_store.LogpStore.fill


def counting_fill(self, engine, batches, temperature):
    done = _fill(self, engine, batches, temperature)
    FORWARDS[0] += done
    return done


reference_store.LogpStore.fill = counting_fill


def run(recipe_path: str, overrides: list, out_dir: Path):
    trainer = Trainer(load_recipe(REPO / recipe_path, [*SHORT, *overrides, f"output_dir={out_dir}"]))
    try:
        trainer.setup()
        trainer.train()
        rank, built, mode = trainer.engine.rank, trainer.engine.has_reference, trainer.reference.mode
    finally:
        trainer.close(destroy_process_group=False)
    rows = []
    if rank == 0:
        for name in ("metrics.jsonl", "eval.jsonl"):
            lines = (out_dir / name).read_text().splitlines() if (out_dir / name).exists() else []
            rows += [{**{k: v for k, v in json.loads(line).items() if k not in TIMING},
                      **({"kind": "eval"} if name == "eval.jsonl" else {})} for line in lines if line.strip()]
    return rank, rows, built, mode


results, rank = {}, 0
work = Path(sys.argv[1]).parent
for index, spec in enumerate(sys.argv[2:]):
    recipe_path, _, extra = spec.partition("|")
    overrides = [o for o in extra.split(",") if o]
    syncing = load_recipe(REPO / recipe_path, [*SHORT, *overrides]).humanline.sync_every is not None
    free = ["humanline.reference=lookahead"] if syncing else ["train.cache_reference_logps=true"]
    entry = results[spec] = {}
    for name, mode in (("copy", ["humanline.reference=copy"]), ("free", free)):
        FORWARDS[0] = 0
        rank, rows, built, chosen = run(recipe_path, [*overrides, *mode], work / f"{index}-{name}")
        entry.update({name: rows, f"{name}_built": built, f"{name}_mode": chosen, f"{name}_forwards": FORWARDS[0]})
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(results))
