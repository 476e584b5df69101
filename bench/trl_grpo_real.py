"""The pack's online GRPO update against TRL's ``GRPOTrainer`` on the real model (SmolLM2-135M-Instruct, LoRA as in
the demo), side by side in one process.

Both take the real-model study's online arm (``recipes/real/study/online.yaml``): the same converted model, LoRA
rank 8 (alpha 16) on the attention projections, 4 prompts x 8 samples per update at temperature 0.7, at most 10 new
tokens, the demo's two-digit additions with its system prompt, its reward (``eval.addition:sum_credit``), lr 2e-3,
PPO clip 0.2, no KL term, token-level loss, fp32, one thread. The pack runs its own loop (``hl_core.trainer.Trainer``);
TRL runs ``GRPOTrainer`` with a peft ``LoraConfig``. They take turns (pack, TRL, TRL, pack, ...: fresh trainers
from the same weights each turn); each turn's first updates are warm-up. Per timed update: the whole update
(generation, scoring, the loss, backward, the optimizer step) and the update without its generation phase (the
pack's rollout phase, as the pack times it: sampling, scoring and the behaviour policy's log-probs; TRL's
``_generate_and_score_completions``: sampling, scoring and the log-prob passes it makes there), wall-clock and
process CPU seconds. Prints the medians and the ratios pack / TRL.

    python bench/trl_grpo_real.py                    # 2 rounds x (1 warm-up + 3 timed updates) each
    python bench/trl_grpo_real.py --rounds 4 --steps 4
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
from typing import Dict, List

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
warnings.filterwarnings("ignore")
os.environ.setdefault("TQDM_DISABLE", "1")

import torch  # noqa: E402
from datasets import Dataset, disable_progress_bars  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from eval._common import read_jsonl  # noqa: E402
from eval.addition import SYSTEM_PROMPT, problems, sum_credit  # noqa: E402
from hl_core.callbacks import LoopCallback  # noqa: E402
from hl_core.config import load_recipe  # noqa: E402
from hl_core.trainer import Trainer  # noqa: E402
from launchers.in_process import restored_process_state  # noqa: E402

RECIPE = REPO / "recipes" / "real" / "study" / "online.yaml"
Times = Dict[str, List[float]]  # "wall", "update_wall" (without generation), "cpu", "update_cpu"


# ------------------------------------------------------------------------------------------------ the pack
class PackClock(LoopCallback):
    """Process CPU seconds at the end of every update, and of the rollouts so far (the rollout source's ``cpu_s``);
    no evaluation runs between updates here."""

    def __init__(self):
        self.trainer = None
        self.marks = [(time.process_time(), 0.0)]

    def after_update(self, ctx) -> None:
        self.marks.append((time.process_time(), self.trainer.source.cpu_s))


def pack_turn(args, out: Path) -> Times:
    """One run of the pack's loop on the study's online recipe; the timed updates' seconds."""
    recipe = load_recipe(RECIPE, [f"train.max_steps={args.warmup + args.steps}", "eval.every=null",
                                  "checkpoint.save_final=false", "train.num_threads=1", f"output_dir={out}",
                                  "logging.progress_bar=false", "checkpoint.resume=never", "checkpoint.overwrite=true",
                                  "rollout.log_samples=false"])
    clock = PackClock()
    clock.trainer = Trainer(recipe, callbacks=[clock])
    with restored_process_state():
        try:
            clock.trainer.setup()
            clock.trainer.train()
        finally:
            clock.trainer.close()
    rows = read_jsonl(out / "metrics.jsonl")[args.warmup:]
    steps = list(zip(clock.marks, clock.marks[1:]))[args.warmup:]
    return {"wall": [r["step_time_s"] for r in rows], "update_wall": [r["step_time_s"] - r["rollout_time_s"]
                                                                      for r in rows],
            "cpu": [b[0] - a[0] for a, b in steps], "update_cpu": [(b[0] - a[0]) - (b[1] - a[1]) for a, b in steps]}


# ------------------------------------------------------------------------------------------------ TRL
class TimedGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer; its generation phase timed (wall and process CPU), nothing else changed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generation: List[tuple] = []

    def _generate_and_score_completions(self, inputs):
        wall, cpu = time.perf_counter(), time.process_time()
        out = super()._generate_and_score_completions(inputs)
        self.generation.append((time.perf_counter() - wall, time.process_time() - cpu))
        return out


class TRLClock(TrainerCallback):
    def __init__(self):
        self.wall, self.cpu, self.start = [], [], (0.0, 0.0)

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = (time.perf_counter(), time.process_time())

    def on_step_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter() - self.start[0])
        self.cpu.append(time.process_time() - self.start[1])


def reward(prompts, completions, answer, **kwargs):
    """``eval.addition.sum_credit`` on TRL's completions (conversational: the assistant message's text)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return sum_credit(prompts, texts, answer)


def trl_turn(model_dir: str, args, out: Path) -> Times:
    """One ``GRPOTrainer.train()`` with the recipe's settings; the timed updates' seconds."""
    from peft import LoraConfig

    rows = problems()["train"]
    data = Dataset.from_dict({"prompt": [[{"role": "system", "content": SYSTEM_PROMPT},
                                          {"role": "user", "content": r["prompt"]}] for r in rows],
                              "answer": [r["answer"] for r in rows]})
    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=32, num_generations=8,
                        max_completion_length=10, temperature=0.7, learning_rate=2e-3, lr_scheduler_type="constant",
                        warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0, beta=0.0, epsilon=0.2, loss_type="dapo",
                        max_steps=args.warmup + args.steps, logging_steps=10**6, save_strategy="no", report_to=[],
                        disable_tqdm=True, log_level="error", bf16=False, use_cpu=True, seed=0)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                               processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=lora)
    trainer.remove_callback(PrinterCallback)
    clock = TRLClock()
    trainer.add_callback(clock)
    trainer.train()
    timed = slice(args.warmup, None)
    generation = trainer.generation[timed]
    return {"wall": clock.wall[timed], "update_wall": [w - g[0] for w, g in zip(clock.wall[timed], generation)],
            "cpu": clock.cpu[timed], "update_cpu": [c - g[1] for c, g in zip(clock.cpu[timed], generation)]}


# ------------------------------------------------------------------------------------------------ main
def table(times: Dict[str, Times]) -> List[str]:
    rows = [("whole update, wall s", "wall"), ("whole update, CPU s", "cpu"),
            ("update without its generation phase, wall s", "update_wall"),
            ("update without its generation phase, CPU s", "update_cpu")]
    lines = [f"| {'measure (median over timed updates)':<46} | {'pack':>8} | {'TRL':>8} | {'pack / TRL':>10} |",
             f"|{'-' * 48}|{'-' * 10}|{'-' * 10}|{'-' * 12}|"]
    for label, key in rows:
        pack, trl = statistics.median(times["pack"][key]), statistics.median(times["trl"][key])
        lines.append(f"| {label:<46} | {pack:>8.2f} | {trl:>8.2f} | {pack / trl:>10.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="turns of each trainer (alternating: ABBA)")
    parser.add_argument("--steps", type=int, default=3, help="timed updates per turn")
    parser.add_argument("--warmup", type=int, default=1, help="untimed updates per turn first")
    args = parser.parse_args()
    disable_progress_bars()
    torch.set_num_threads(1)
    model_dir = load_recipe(RECIPE, []).model.name_or_path  # the converted model directory
    times: Dict[str, Times] = {side: {"wall": [], "update_wall": [], "cpu": [], "update_cpu": []}
                               for side in ("pack", "trl")}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in (("pack", "trl") if r % 2 == 0 else ("trl", "pack")):
                out = Path(tmp) / f"{side}{r}"
                got = pack_turn(args, out) if side == "pack" else trl_turn(model_dir, args, out)
                for key, values in got.items():
                    times[side][key] += values
                print(f"round {r} {side}: whole update wall " + ", ".join(f"{v:.1f}" for v in got["wall"]) + " s",
                      flush=True)
    print(f"SmolLM2-135M-Instruct, LoRA r 8 on q/k/v/o, 4 prompts x 8 samples, <= 10 new tokens, fp32, "
          f"{torch.get_num_threads()} thread; {len(times['pack']['wall'])} timed updates each, {args.rounds} rounds "
          f"alternating; load average {os.getloadavg()[0]:.1f} at the end")
    print("\n".join(table(times)))


if __name__ == "__main__":
    main()
