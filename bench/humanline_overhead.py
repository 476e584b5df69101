"""Humanline overhead: plain DPO vs humanline DPO (k = 1, clip) side by side, in one process.

Both runs are set up in the same process and their optimizer steps are interleaved (plain, humanline,
plain, ...), so machine noise hits both alike. Prints the ratio of mean step times and the reference
sync time as a fraction of a humanline step. Targets: ratio <= 1.03, sync <= 2% of a step.

    python bench/humanline_overhead.py                       # tiny recipe, a ~4M-parameter model
    python bench/humanline_overhead.py --steps 60 model.config_overrides.hidden_size=512
    torchrun --nproc_per_node 2 bench/humanline_overhead.py engine.zero_stage=3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402

DEFAULTS = [
    "model.config_overrides.hidden_size=256", "model.config_overrides.intermediate_size=1024",
    "model.config_overrides.num_hidden_layers=4", "eval.every=null", "checkpoint.save_every=null",
    "checkpoint.save_final=false", "logging.progress_bar=false", "train.lr=1e-4",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="measured updates per run")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured updates per run first")
    parser.add_argument("overrides", nargs="*", help="recipe overrides applied to both runs")
    args = parser.parse_args()
    total = args.steps + args.warmup
    with tempfile.TemporaryDirectory() as tmp:
        common = DEFAULTS + [f"train.max_steps={total}"] + args.overrides
        runs = {
            "plain": Trainer(load_recipe(REPO / "recipes/tiny/offline_dpo.yaml", common + [f"output_dir={tmp}/plain"])),
            "humanline": Trainer(load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", common
                                             + [f"output_dir={tmp}/hl"])),
        }
        for trainer in runs.values():
            trainer.setup()
        rows = {name: [] for name in runs}
        for step in range(total):
            order = list(runs) if step % 2 == 0 else list(reversed(runs))  # alternate who goes first
            for name in order:
                row = runs[name].train_step()
                if step >= args.warmup:
                    rows[name].append(row)
        main_rank = runs["plain"].is_main
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in runs["plain"].engine.policy.module.parameters())
        for trainer in runs.values():
            trainer.close(destroy_process_group=False)

    if not main_rank:
        return
    plain = statistics.mean(r["step_time_s"] for r in rows["plain"])
    hl = statistics.mean(r["step_time_s"] for r in rows["humanline"])
    sync = statistics.mean(r["sync_time_s"] for r in rows["humanline"])
    med_ratio = statistics.median(h["step_time_s"] / p["step_time_s"] for h, p in zip(rows["humanline"], rows["plain"]))
    assert all(r["synced"] for r in rows["humanline"]) and not any(r["synced"] for r in rows["plain"])
    print(f"model parameters: {n_params:,}; measured updates per run: {args.steps}")
    print(f"mean step time   plain DPO      {plain * 1e3:8.2f} ms")
    print(f"mean step time   humanline DPO  {hl * 1e3:8.2f} ms   (k=1 sync + clip [-1.5, 1.5])")
    print(f"ratio humanline / plain (means)          {hl / plain:.3f}   target <= 1.03")
    print(f"ratio humanline / plain (median paired)  {med_ratio:.3f}")
    print(f"sync time {sync * 1e3:.3f} ms = {100 * sync / hl:.2f}% of a humanline step   target <= 2%")


if __name__ == "__main__":
    main()
