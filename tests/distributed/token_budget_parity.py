"""Token-budget micro-batches against fixed ones through the real trainer, in one process (or under torchrun,
one per rank): for each ``recipe|override,...|budget`` argument, three updates with fixed micro-batches and three
with ``train.max_tokens_per_micro_batch=budget`` from the same start, each with a fresh Trainer; rank 0 writes
``{name: {"fixed": rows, "budget": rows, "<mode>_micro": [[units per micro-batch, ...] per update]}}`` (timing
fields dropped; a dummy micro-batch counts as 0 units) as JSON to argv[1]; rank r > 0 writes its own
``<mode>_micro`` to ``argv[1].rank<r>``."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

TIMING = ("step_time_s", "sync_time_s", "rollout_time_s", "train_time_s", "tokens_per_s")
SHORT = ["train.max_steps=3", "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false",
         "logging.progress_bar=false", "checkpoint.resume=never"]
UNIT_ROWS = {"dpo": 2, "kto": 1, "sft": 1}


def units(batch, objective: str) -> int:
    if batch.get("dummy"):
        return 0
    if objective == "grpo":
        return int(batch["group_ids"].max()) + 1
    return int(batch["input_ids"].shape[0]) // UNIT_ROWS[objective]


def three_updates(recipe_path: str, overrides: list, out_dir: Path):
    trainer = Trainer(load_recipe(REPO / recipe_path, [*SHORT, *overrides, f"output_dir={out_dir}"]))
    micro = []
    try:
        trainer.setup()
        batches_of = trainer.source.batches

        def recorded(step):
            batches = batches_of(step)
            micro.append([units(b, trainer.recipe.objective.name) for b in batches])
            return batches

        trainer.source.batches = recorded
        rows = [trainer.train_step() for _ in range(3)]
        rank = trainer.engine.rank
    finally:
        trainer.close(destroy_process_group=False)
    return rank, [{k: v for k, v in row.items() if k not in TIMING} for row in rows], micro


results, rank = {}, 0
work = Path(sys.argv[1]).parent
for spec in sys.argv[2:]:
    recipe_path, extra, budget = spec.split("|")
    overrides = [o for o in extra.split(",") if o]
    name = Path(recipe_path).stem + (f"[{extra}]" if extra else "")
    results[name] = {}
    for mode in ("fixed", "budget"):
        setting = f"train.max_tokens_per_micro_batch={budget if mode == 'budget' else 'null'}"
        rank, rows, micro = three_updates(recipe_path, [*overrides, setting], work / f"{len(results)}-{mode}")
        results[name][mode] = rows
        results[name][f"{mode}_micro"] = micro
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(results))
else:  # the other ranks' micro-batch sizes: where the dummy micro-batches are
    Path(f"{sys.argv[1]}.rank{rank}").write_text(json.dumps({n: {k: v for k, v in r.items() if k.endswith("_micro")}
                                                              for n, r in results.items()}))
