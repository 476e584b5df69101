"""Humanline GRPO on TRL's own GRPOTrainer, on offline groups (prompt, scored completions): the ratio is exp() of
the clipped log-ratio against a reference synced every k updates, then PPO-clipped. Nothing is generated.

    python examples/trl_grpo.py                # CPU, the tiny model and groups, 8 updates
    accelerate launch --config_file zero3.yaml examples/trl_grpo.py --model Qwen/Qwen2.5-1.5B-Instruct \
        --data groups.jsonl --steps 1000 --clip -1.5 1.5 --sync-every 12

Needs the `trl` extra: `pip install -e ".[trl]"` (without it the script says so and exits 2).
"""

from _extras import require_extra

require_extra("trl", "trl")  # before the imports that need it: one paragraph and exit 2

import argparse
import json
import warnings
from pathlib import Path

from _launch import TINY, load_model, train_and_print
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig

from hl_core.humanline import ClipTransform, SyncSchedule
from hl_core.integrations.trl import HumanlineGRPOTrainer

warnings.filterwarnings("ignore", category=FutureWarning)


def offline_groups(path, tokenizer, group_size):
    """One row per completion (``prompt_ids``, ``completion_ids``, ``score``), a group's rows consecutive."""
    rows = []
    for line in filter(str.strip, Path(path).read_text().splitlines()):
        group = json.loads(line)
        assert len(group["completions"]) == group_size, "every group needs --group-size completions"
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": group["prompt"]}],
                                               add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for completion, score in zip(group["completions"], group["scores"]):
            completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append({"prompt_ids": prompt_ids, "completion_ids": completion_ids, "score": score})
    return Dataset.from_list(rows)


def main(args):
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = GRPOConfig(output_dir=args.output_dir, per_device_train_batch_size=args.groups * args.group_size,
                        num_generations=args.group_size, max_steps=args.steps, learning_rate=args.lr, beta=0.0,
                        epsilon=0.2, loss_type="bnpo", bf16=False, gradient_checkpointing=False, logging_steps=1,
                        save_strategy="no", report_to=[], disable_tqdm=True, log_level="error")
    trainer = HumanlineGRPOTrainer(
        load_model(args.model, args.seed), reward_funcs=[], args=config, processing_class=tokenizer,
        train_dataset=offline_groups(args.data, tokenizer, args.group_size),
        transform=ClipTransform(*args.clip),  # the per-token log-ratio clamped before exp()
        schedule=SyncSchedule(every=args.sync_every),  # reference <- pre-update policy every k updates, shard-local
    )
    train_and_print(trainer)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(TINY / "model"))
    parser.add_argument("--data", default=str(TINY / "groups" / "train.jsonl"))
    parser.add_argument("--output-dir", default="runs/trl_grpo")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--groups", type=int, default=2, help="prompt groups per process per update")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--sync-every", type=int, default=2)
    parser.add_argument("--clip", type=float, nargs=2, default=(-0.05, 0.05), metavar=("LOG_EPS_P", "LOG_EPS_R"))
    parser.add_argument("--seed", type=int, default=0)
    main(parser.parse_args())
