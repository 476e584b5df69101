"""Run under torchrun: build each named recipe's real engine and report whether it holds a reference model.

argv: report.json then ``engine|recipe|override,override,...`` triples (overrides may be empty). For each it
records ``has_reference``, whether the reference module exists, its parameter count, and the error that
asking for reference log-probs raises when there is none. Engines share one process group.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from hl_core.config import engine_spec, load_recipe  # noqa: E402
from hl_core.engines import build_engine  # noqa: E402
from hl_core.models.loading import load_tokenizer  # noqa: E402

report = {}
for spec in sys.argv[2:]:
    name, recipe_path, overrides = spec.split("|")
    recipe = load_recipe(recipe_path, [o for o in overrides.split(",") if o] + ["logging.progress_bar=false"])
    tokenizer = load_tokenizer(recipe.model)
    engine = build_engine(engine_spec(recipe), tokenizer)
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    entry = {"has_reference": engine.has_reference, "reference_built": engine.reference is not None,
             "reference_params": sum(getattr(p, "ds_numel", p.numel()) for p in engine.reference.parameters())
             if engine.reference else 0,
             "policy_logps_shape": list(engine.token_logps(batch, "policy").shape)}
    for call in ("logps", "sync"):
        try:
            engine.token_logps(batch, "reference") if call == "logps" else engine.reference_pairs().sync()
            entry[f"reference_{call}_error"] = None
        except RuntimeError as exc:
            entry[f"reference_{call}_error"] = str(exc)
    report[name] = entry
    engine.close(destroy_process_group=False)
if torch.distributed.get_rank() == 0:
    Path(sys.argv[1]).write_text(json.dumps(report))
torch.distributed.destroy_process_group()
