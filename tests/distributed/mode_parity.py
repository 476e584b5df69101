"""One setting against another through the real trainer, in one process (or under torchrun, one per rank): for each
``recipe|override,override,...`` argument, three updates in each mode from the same start, each with a fresh
Trainer. Modes: ``mode:NAME=override,override`` arguments (before the recipes), by default ``padded``
(``data.packing=false``) and ``packed`` (``data.packing=true``). Rank 0 writes ``{name: {MODE: rows,
"<MODE>_forwards": [(rows, bins) of each packed forward], "<MODE>_fused_calls": log-prob calls from the hidden
states, "<MODE>_summary": the engine's summary fields}}`` (timing fields dropped) as JSON to argv[1]."""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import hl_core.logprobs.hidden as hidden  # noqa: E402
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
FUSED_CALLS = []  # tokens of each log-prob call from the hidden states: proof that train.fused_logprobs ran
_hidden_token_logps = hidden.hidden_token_logps


def counting_hidden_token_logps(hidden_states, weight, labels, *args, **kwargs):
    FUSED_CALLS.append(int(labels.numel()))
    return _hidden_token_logps(hidden_states, weight, labels, *args, **kwargs)


hidden.hidden_token_logps = counting_hidden_token_logps

TIMING = ("step_time_s", "sync_time_s", "rollout_time_s", "train_time_s", "tokens_per_s")
SHORT = ["train.max_steps=3", "eval.every=null", "checkpoint.save_every=null", "checkpoint.save_final=false",
         "logging.progress_bar=false", "checkpoint.resume=never"]


def three_updates(recipe_path: str, overrides: list, out_dir: Path):
    trainer = Trainer(load_recipe(REPO / recipe_path, [*SHORT, *overrides, f"output_dir={out_dir}"]))
    try:
        trainer.setup()
        rows = [trainer.train_step() for _ in range(3)]
        rank, summary = trainer.engine.rank, trainer.engine.summary_fields()
    finally:
        trainer.close(destroy_process_group=False)
    return rank, [{k: v for k, v in row.items() if k not in TIMING} for row in rows], summary


modes = {"padded": ["data.packing=false"], "packed": ["data.packing=true"]}
args = sys.argv[2:]
given = [a[len("mode:"):] for a in args if a.startswith("mode:")]
if given:
    modes = {name: [o for o in extra.split(",") if o] for name, _, extra in (m.partition("=") for m in given)}
results, rank = {}, 0
work = Path(sys.argv[1]).parent
for spec in (a for a in args if not a.startswith("mode:")):
    recipe_path, _, extra = spec.partition("|")
    overrides = [o for o in extra.split(",") if o]
    name = Path(recipe_path).stem + (f"[{extra}]" if extra else "")
    results[name] = {}
    for mode, mode_overrides in modes.items():
        PACKED_FORWARDS.clear()
        FUSED_CALLS.clear()
        rank, rows, summary = three_updates(recipe_path, [*overrides, *mode_overrides], work / f"{len(results)}-{mode}")
        results[name][mode] = rows
        results[name][f"{mode}_forwards"] = list(PACKED_FORWARDS)
        results[name][f"{mode}_summary"] = summary
        results[name][f"{mode}_fused_calls"] = len(FUSED_CALLS)
if rank == 0:
    Path(sys.argv[1]).write_text(json.dumps(results))
