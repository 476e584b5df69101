"""Online GRPO vs offline + humanline GRPO: wall-clock for the same number of optimizer updates.

1. Online GRPO (`recipes/tiny/online_grpo_math.yaml`): the policy generates and scores fresh groups every
   update; its samples are logged.
2. Those logged groups become a fixed offline data set (prompt, completions, scores).
3. Offline + humanline GRPO (`recipes/tiny/humanline_grpo.yaml`: syncing k=1, clipping) trains on it for
   the same number of updates with the same micro-batch of groups.

Prints the ratio of training-loop wall-clock (online / offline), the share of online time spent
generating and scoring, and the generation length it was measured at. The paper reports > 6x on GPU
(Llama3-8B, long generations); here the ratio grows with `--max-new-tokens`.

    python bench/online_vs_offline.py                          # tiny model, 16 updates, 24 new tokens
    python bench/online_vs_offline.py --steps 32 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hl_core import children  # noqa: E402 (after the path insert; each run ends with this script)


def run(recipe: str, overrides, cwd: Path) -> dict:
    cmd = [sys.executable, str(REPO / "launchers" / "run.py"), str(REPO / recipe), *overrides,
           "logging.progress_bar=false"]
    env = dict(os.environ, PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false")
    proc = children.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{recipe} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    out = Path(next(o.split("=", 1)[1] for o in overrides if o.startswith("output_dir=")))
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--generations", type=int, default=4)
    args = parser.parse_args()
    common = [f"train.max_steps={args.steps}", "eval.every=null", "checkpoint.save_every=null",
              "checkpoint.save_final=false", "train.micro_batch_size=2"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        online = run("recipes/tiny/online_grpo_math.yaml", common + [
            f"output_dir={tmp / 'online'}", "rollout.log_samples=true", f"rollout.max_new_tokens={args.max_new_tokens}",
            f"rollout.num_generations={args.generations}",
        ], tmp)
        groups = []
        for path in sorted((tmp / "online" / "rollouts").glob("rank*.jsonl")):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                completions = [c if c.strip() else "." for c in row["completions"]]  # the loader rejects empty text
                groups.append({"prompt": row["prompt"], "completions": completions, "scores": row["scores"]})
        data = tmp / "offline_groups.jsonl"
        data.write_text("".join(json.dumps(g) + "\n" for g in groups))
        offline = run("recipes/tiny/humanline_grpo.yaml", common + [
            f"output_dir={tmp / 'offline'}", f"data.train.path={data}", "data.eval=null",
        ], tmp)
    gen_len = args.max_new_tokens
    ratio = online["mean_step_s"] / offline["mean_step_s"]
    print(f"updates per run: {args.steps}; groups of {args.generations}; generation cap {gen_len} new tokens")
    print(f"online GRPO                mean update {online['mean_step_s'] * 1e3:8.1f} ms "
          f"(generation + scoring {100 * online['rollout_frac']:.1f}% of it)")
    print(f"offline + humanline GRPO   mean update {offline['mean_step_s'] * 1e3:8.1f} ms (no generation)")
    print(f"wall-clock ratio online / offline+humanline: {ratio:.2f}x")


if __name__ == "__main__":
    main()
