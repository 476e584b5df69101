"""Packed against padded through the real trainer, in one process (or under torchrun, one per rank): for each
``recipe|override,override,...`` argument, three updates padded and three packed from the same start, each
with a fresh Trainer; rank 0 writes ``{name: {"padded": rows, "packed": rows, "<mode>_forwards": [(rows, bins)
of each packed forward]}}`` (timing fields dropped) as JSON to argv[1]."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hl_core.logprobs.packed as packing  # noqa: E402
from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

PACKED_FORWARDS = []  # (rows, bins) of every packed forward: proof that the packed path ran
_pack_rows = packing.pack_rows


def counting_pack_rows(input_ids, *args, **kwargs):
    packed = _pack_rows(input_ids, *args, **kwargs)
    PACKED_FORWARDS.append((int(input_ids.shape[0]), int(packed.input_ids.shape[0])))
    return packed


packing.pack_rows = counting_pack_rows

TIMING = ("step_time_s", "sync_time_s", "rollout_time_s", "train_time_s", "tokens_per_s")
SHORT = ["train.max_steps=3", "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false",
         "logging.progress_bar=false", "checkpoint.resume=never"]


def three_updates(recipe_path: str, overrides: list, out_dir: Path) -> list:
    trainer = Trainer(load_recipe(REPO / recipe_path, [*SHORT, *overrides, f"output_dir={out_dir}"]))
    try:
        trainer.setup()
        rows = [trainer.train_step() for _ in range(3)]
        rank = trainer.engine.rank
    finally:
        trainer.close(destroy_process_group=False)
    return rank, [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


results, rank = {}, 0
work = Path(sys.argv[1]).parent
for spec in sys.argv[2:]:
    recipe_path, _, extra = spec.partition("|")
    overrides = [o for o in extra.split(",") if o]
    name = Path(recipe_path).stem + (f"[{extra}]" if extra else "")
    results[name] = {}
    for mode in ("padded", "packed"):
        PACKED_FORWARDS.clear()
        rank, rows = three_updates(recipe_path, [*overrides, f"data.packing={mode == 'packed'}"],
                                   work / f"{len(results)}-{mode}")
        results[name][mode] = rows
        results[name][f"{mode}_forwards"] = list(PACKED_FORWARDS)
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(results))
