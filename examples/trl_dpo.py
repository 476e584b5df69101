"""Humanline DPO on TRL's own DPOTrainer: swap the class, pass a clip and a sync schedule; TRL does the rest.

    python examples/trl_dpo.py                 # CPU, the tiny model and pairs, 8 updates
    accelerate launch --config_file zero3.yaml examples/trl_dpo.py --model meta-llama/Meta-Llama-3-8B-Instruct \
        --data pairs.jsonl --steps 1000 --clip -1.5 1.5 --sync-every 1

Needs the `trl` extra: `pip install -e ".[trl]"` (without it the script says so and exits 2).
"""

from _extras import require_extra

require_extra("trl", "trl")  # before the imports that need it: one paragraph and exit 2

import argparse
import json
import warnings
from pathlib import Path

from _launch import TINY, load_model, train_and_print
from datasets import Dataset, disable_progress_bars
from transformers import AutoTokenizer
from trl import DPOConfig

from hl_core.humanline import ClipTransform, SyncSchedule
from hl_core.integrations.trl import HumanlineDPOTrainer

warnings.filterwarnings("ignore", category=FutureWarning)
disable_progress_bars()


def conversational(path):
    """TRL's conversational preference rows: the user turn, then each assistant answer."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return Dataset.from_list([{"prompt": r["chosen"][:-1], "chosen": r["chosen"][-1:],
                               "rejected": r["rejected"][-1:]} for r in rows])


def main(args):
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = DPOConfig(output_dir=args.output_dir, per_device_train_batch_size=args.batch, max_steps=args.steps,
                       learning_rate=args.lr, beta=args.beta, max_length=args.max_length, bf16=False,
                       gradient_checkpointing=False, logging_steps=1, save_strategy="no", report_to=[],
                       disable_tqdm=True, log_level="error")
    trainer = HumanlineDPOTrainer(
        load_model(args.model, args.seed), ref_model=load_model(args.model, args.seed), args=config,
        train_dataset=conversational(args.data), processing_class=tokenizer,
        transform=ClipTransform(*args.clip),  # per-token log-ratios clamped before TRL's sequence sums
        schedule=SyncSchedule(every=args.sync_every),  # reference <- pre-update policy every k updates, shard-local
    )
    train_and_print(trainer)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(TINY / "model"))
    parser.add_argument("--data", default=str(TINY / "prefs" / "train.jsonl"))
    parser.add_argument("--output-dir", default="runs/trl_dpo")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="pairs per process per update")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--clip", type=float, nargs=2, default=(-0.05, 0.05), metavar=("LOG_EPS_P", "LOG_EPS_R"))
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
