"""bf16 against fp32: the same humanline DPO run in both precisions, side by side, on the CPU.

    python bench/bf16_vs_fp32.py                 # the tiny recipe, 40 updates, two humanline settings
    python bench/bf16_vs_fp32.py --steps 80

For each setting (syncing every update with the clip, the paper's instruction-following default; and
the clip against a frozen reference, where it binds) it trains the tiny model twice from the same
weights and data order, fp32 and bf16 (DeepSpeed ZeRO-0; bf16 keeps fp32 master weights), and prints:
per-update loss difference (max and mean), the clip's unclamped fraction in the first update and over
the run, the held-out preference accuracy at the end, and how many log-ratios are exactly zero in the
last update (bf16 weights that did not move).

What bf16 changes in the method, and what it does not: log-probs are always computed in float32 from
the (bf16) logits (``hl_core.logprobs``), so the log-ratios, the clamp and the losses are float32; what
bf16 changes is the logits themselves (rounded to 8 bits of mantissa) and which weight updates are large
enough to change a bf16 weight at all.
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

SETTINGS = {
    "sync k=1 + clip": ["humanline.sync_every=1"],
    "frozen reference + clip": ["humanline.sync_every=null"],
}


def run(precision: str, extra: list, steps: int, out: Path):
    common = [f"engine.precision={precision}", "engine.zero_stage=0", f"train.max_steps={steps}", "eval.every=null",
              "checkpoint.save_every=null", "checkpoint.save_final=false", "logging.progress_bar=false",
              f"output_dir={out}"]
    trainer = Trainer(load_recipe(REPO / "recipes/tiny/humanline_dpo.yaml", common + extra))
    trainer.setup()
    rows = [trainer.train_step() for _ in range(steps)]
    zeros = _zero_log_ratio_share(trainer)
    accuracy = trainer._evaluate()["rewards/accuracy"]
    trainer.close(destroy_process_group=False)
    return rows, zeros, accuracy


def _zero_log_ratio_share(trainer) -> float:
    """Share of completion tokens whose policy - reference log-ratio is exactly 0 on the next batch."""
    import torch

    batch = trainer.source.batches(trainer.updates_done)[0]
    with torch.no_grad():
        policy = trainer.engine.token_logps(batch, "policy")
        reference = trainer.engine.token_logps(batch, "reference")
    mask = batch["completion_mask"].bool()
    return ((policy - reference)[mask] == 0).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    print(f"tiny humanline DPO, {args.steps} updates, DeepSpeed ZeRO-0, CPU")
    print("| setting | max / mean abs loss diff | unclamped, update 0 (fp32 / bf16) | unclamped, mean (fp32 / bf16) "
          "| held-out accuracy (fp32 / bf16) | log-ratios exactly 0, last update (fp32 / bf16) |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in SETTINGS.items():
            (f32, z32, a32), (b16, z16, a16) = (run(p, extra, args.steps, Path(tmp) / f"{p}{len(name)}") for p
                                                in ("fp32", "bf16"))
            diffs = [abs(x["loss"] - y["loss"]) for x, y in zip(f32, b16)]
            u32, u16 = [r["unclamped_frac"] for r in f32], [r["unclamped_frac"] for r in b16]
            print(f"| {name} | {max(diffs):.4f} / {statistics.fmean(diffs):.4f} | {u32[0]:.4f} / {u16[0]:.4f} | "
                  f"{statistics.fmean(u32):.4f} / {statistics.fmean(u16):.4f} | {a32:.3f} / {a16:.3f} | {z32:.3f} / "
                  f"{z16:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
