"""TRL adapter overhead: humanline DPO (``HumanlineDPOTrainer``: clip + shard-local sync every update) vs TRL's plain
``DPOTrainer`` on the same model, the same rows and the same settings, side by side in one process.

The two trainers take turns (plain, humanline, humanline, plain, ... : one ``train()`` each per turn, fresh
trainers from the same weights); each turn's first updates are warm-up and the rest are timed from
``on_step_begin`` to ``on_step_end`` (forward, backward, clipping, the sync, the optimizer step). Prints the median
update time of each and their ratio. Target: ratio <= 1.05.

    python bench/trl_dpo_overhead.py                      # CPU, a ~3M-parameter Llama (the tiny one, widened)
    python bench/trl_dpo_overhead.py --rounds 6 --hidden 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from datasets import Dataset, disable_progress_bars  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback  # noqa
from trl import DPOConfig, DPOTrainer  # noqa: E402

from hl_core.data import load_preference_records, tokenize_preference  # noqa: E402
from hl_core.humanline import ClipTransform, SyncSchedule  # noqa: E402
from hl_core.integrations.trl import HumanlineDPOTrainer  # noqa: E402

TINY = REPO / "tests" / "fixtures" / "tiny"


class PlainDPOTrainer(DPOTrainer):
    """TRL's DPOTrainer, unchanged but for taking the same token ids (no re-tokenizing)."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


class Clock(TrainerCallback):
    def __init__(self, warmup):
        self.warmup, self.times, self.start = warmup, [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step > self.warmup:
            self.times.append(time.perf_counter() - self.start)


def rows(tokenizer) -> Dataset:
    out = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
    for record in load_preference_records(path=str(TINY / "prefs" / "train.jsonl")):
        pair = tokenize_preference(record, tokenizer, 64, 32)
        start = pair["chosen_completion_mask"].index(1)
        out["prompt_ids"].append(pair["chosen_input_ids"][:start])
        out["chosen_ids"].append(pair["chosen_input_ids"][start:])
        out["rejected_ids"].append(pair["rejected_input_ids"][start:])
    return Dataset.from_dict(out)


def turn(humanline: bool, weights: Path, data: Dataset, tokenizer, args, tmp: str) -> list:
    load = lambda: AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)  # noqa: E731
    config = DPOConfig(output_dir=tmp, per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps,
                       learning_rate=1e-4, beta=0.1, max_length=None, bf16=False, gradient_checkpointing=False,
                       logging_steps=10**6, save_strategy="no", report_to=[], disable_tqdm=True, log_level="error",
                       train_sampling_strategy="sequential")
    extra = {"transform": ClipTransform(), "schedule": SyncSchedule(every=1)} if humanline else {}
    cls = HumanlineDPOTrainer if humanline else PlainDPOTrainer
    trainer = cls(load(), ref_model=load(), args=config, train_dataset=data, processing_class=tokenizer, **extra)
    trainer.remove_callback(PrinterCallback)
    clock = Clock(args.warmup)
    trainer.add_callback(clock)
    trainer.train()
    return clock.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="turns of each trainer (alternating, ABBA)")
    parser.add_argument("--steps", type=int, default=12, help="timed updates per turn")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates per turn first")
    parser.add_argument("--batch", type=int, default=8, help="pairs per update")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(TINY / "model")
    data = rows(tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        config = AutoConfig.from_pretrained(TINY / "model", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                            num_hidden_layers=args.layers, head_dim=args.hidden // 4)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(Path(tmp) / "model")
        params = sum(p.numel() for p in model.parameters())
        times = {False: [], True: []}
        for r in range(args.rounds):
            for humanline in ((False, True) if r % 2 == 0 else (True, False)):
                times[humanline] += turn(humanline, Path(tmp) / "model", data, tokenizer, args, tmp)
    plain, hl = statistics.median(times[False]), statistics.median(times[True])
    print(f"model {params / 1e6:.1f}M parameters, {args.batch} pairs per update, CPU, torch threads "
          f"{torch.get_num_threads()}; {len(times[False])} timed updates each")
    print(f"{'trainer':<44}{'median update (ms)':>20}")
    print(f"{'TRL DPOTrainer (plain)':<44}{plain * 1e3:>20.1f}")
    print(f"{'HumanlineDPOTrainer (clip, sync every update)':<44}{hl * 1e3:>20.1f}")
    print(f"ratio humanline / plain: {hl / plain:.3f}  (target <= 1.05)")


if __name__ == "__main__":
    main()
