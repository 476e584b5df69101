"""The online GRPO digits recipe at several rollout seeds, one process, one backend: run in the vLLM environment.

    python tests/vllm_cpu/digits_seeds.py OUT.json BACKEND SEED[,SEED...] [--stale SEED[,SEED...]]

Each seed is one whole run of ``launchers/run.py`` (world size 1), called in this process one after another
(`launchers.in_process`: the imports and vLLM's first engine start are paid once, so a seed costs seconds).
Every run starts from the same weights (the recipe's ``train.seed``); ``rollout.seed`` changes only the rollout and
evaluation samples. OUT.json: ``{"fresh": {seed: [held-out evaluation rows of eval.jsonl]}, "stale": {...}}``.

``--stale SEEDS``, after the others, is the negative control of the learning comparison: the vLLM engine takes the
policy's weights at its first push only and keeps them, so it rolls out (and evaluates) the start policy throughout.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes/tiny/online_grpo_digits.yaml"
# the head_dim-32 variant (vLLM's CPU attention needs head_dim >= 32), for both backends: one model, one start
COMMON = ["model.name_or_path=tests/fixtures/tiny/model_hd32", "rollout.vllm.kv_cache_memory_gb=0.0625",
          "logging.progress_bar=false"]


def keep_first_weights() -> None:
    """``--stale``: every push after a sampler's first does nothing."""
    from hl_core.rollout.vllm_sampler import VLLMSampler

    push = VLLMSampler.push_weights

    def first_only(self, reset_prefix_cache: bool = True):
        if self.pushes == 0:
            push(self, reset_prefix_cache)

    VLLMSampler.push_weights = first_only


def run_seed(backend: str, seed: int, out: Path) -> list:
    """One run of the recipe at rollout seed ``seed``: its held-out evaluations."""
    from launchers import run
    from launchers.in_process import guarded_call, restored_process_state

    with restored_process_state():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
        _, code = guarded_call(lambda: run.main([str(RECIPE), f"rollout.backend={backend}", f"rollout.seed={seed}",
                                                 f"output_dir={out}", *COMMON]))
    if code not in (None, 0):
        raise SystemExit(f"the {backend} run at rollout seed {seed} exited {code}")
    return [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]


def main(argv) -> int:
    out_path, backend = Path(argv[1]), argv[2]
    seeds = [int(s) for s in argv[3].split(",")]
    stale = [int(s) for s in argv[argv.index("--stale") + 1].split(",")] if "--stale" in argv else []
    sys.path.insert(0, str(REPO))
    results = {"fresh": {}, "stale": {}}
    for seed in seeds:
        results["fresh"][seed] = run_seed(backend, seed, out_path.parent / f"{backend}-seed{seed}")
    if stale:
        keep_first_weights()
    for seed in stale:
        results["stale"][seed] = run_seed(backend, seed, out_path.parent / f"{backend}-stale-seed{seed}")
    out_path.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
