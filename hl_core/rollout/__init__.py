"""Rollouts inside the training loop: online (every update), sparse (every N updates), never (offline).

At a rollout update ``n`` (``n % every == 0``) the current policy writes the completions for updates
``n .. n + every - 1``: for each prompt ``num_generations`` samples, scored by the reward. Each later
update consumes its share, so with ``every = N`` the samples of update ``n + k`` are ``k`` updates
stale (the paper's "64x sparser" shape). What a prompt's samples become depends on the objective's
data kind:

* grouped (GRPO): one group = the prompt's generations with their scores (``rollout.group: best_worst``: only
  the best and the worst, weight 0 unless their scores differ by more than ``rollout.threshold``);
* paired (DPO): best vs worst generation, kept (weight 1) when their scores differ by more than
  ``rollout.threshold``, else carried with weight 0;
* unpaired (KTO): the same best (desirable) and worst (undesirable) pair as two examples.

Standard GRPO (humanline off) keeps the behaviour policy's log-probs from rollout time as ``old_logps``
(so the online ratio is exactly 1); humanline GRPO uses the synced reference instead.

``rollout.replay`` reads each rollout's groups from a run's ``rollout.log_samples`` log instead of sampling them
(``hl_core.rollout.replay``): with ``rollout.every`` = ``train.max_steps`` that is an offline set sampled once from
the initial policy and shared by several runs.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ..config.decisions import Sampling
from ..loop.micro_batches import update_batches
from .generation import build_sampler, prompt_seed
from .heldout import check_prompts_have_references
from .replay import SampleReplay
from .rewards import best_and_worst, build_reward


def is_rollout_step(updates_done: int, every: Optional[int]) -> bool:
    """Rollout before update ``n`` when ``n % every == 0``; never when ``every`` is None."""
    return every is not None and updates_done % every == 0


class RolloutSource:
    """Produces the training micro-batches of each update from fresh (or buffered) generations.

    Args:
        sampling: what generation reads (``hl_core.config.Sampling``: the ``rollout`` section and more).
        train: the recipe's ``train`` section (the run's last update, the micro-batch size or token budget).
        output_dir: the run's directory (``rollout.log_samples`` writes under ``rollouts/``).
        engine: the run's.
        tokenizer: the run's.
        prompts: the train split, a ``TokenizedDataset`` of ``{"prompt_ids", "reference", "messages"}``.
        collate: the objective's collate function for its examples.
        data_kind: the objective's ``DATA_KINDS`` key.
        positions: position -> dataset index (the shared, seeded data order).
        needs_old_logps: keep the behaviour policy's log-probs (``hl_core.config.needs_old_logps``).
        logps_temperature: the temperature of those log-probs.
    """

    # the metrics ``before_step`` reports (besides the ``rollout`` flag); held-out ones: ``heldout.HeldOutReward``
    METRIC_KEYS = ("rollout_time_s", "reward_mean", "reward_std", "gen_len_mean", "gen_len_max", "pairs_kept_frac")

    def __init__(self, sampling: Sampling, train, output_dir: Path, engine, tokenizer, prompts, collate,
                 data_kind: str, positions, needs_old_logps: bool, logps_temperature: float):
        self.train, self.engine, self.tokenizer = train, engine, tokenizer
        self.cfg = sampling.rollout
        self.prompts = prompts
        self.collate = collate
        self.data_kind = data_kind
        self.positions = positions
        self.needs_old_logps = needs_old_logps
        self.logps_temperature = logps_temperature
        self.reward = build_reward(self.cfg.reward)
        self.sampler = build_sampler(engine, tokenizer, sampling)
        self.seed = sampling.seed
        self.buffer: Dict[int, List[dict]] = {}
        self.replay = SampleReplay(self.cfg.replay, self.cfg.num_generations) if self.cfg.replay else None
        self.cpu_s = 0.0  # process CPU seconds of this run's rollouts (the summary's `rollout_cpu_s`)
        self.sample_log = None
        if self.cfg.log_samples:
            self.sample_log = Path(output_dir) / "rollouts" / f"rank{engine.rank:05d}.jsonl"
            self.sample_log.parent.mkdir(parents=True, exist_ok=True)
        check_prompts_have_references(prompts, self.cfg.reward.kind, "training")

    # ------------------------------------------------------------------------------------- training
    def before_step(self, step: int) -> Dict[str, float]:
        """Generate for ``step .. step + every - 1`` when ``step`` is a rollout step; returns metrics."""
        metrics: Dict[str, float] = {"rollout": False, "rollout_time_s": 0.0}
        if not is_rollout_step(step, self.cfg.every) and step in self.buffer:
            return metrics
        start, cpu = time.perf_counter(), time.process_time()
        self.sampler.push_weights()
        train = self.train
        last = min(step + self.cfg.every, train.max_steps)
        scores_all, lengths, kept = [], [], []
        for future in range(step, last):
            update_features = []
            for micro_index in range(self.engine.gradient_accumulation_steps):
                features, info = self._examples(
                    list(self.engine.micro_batch_positions(future, micro_index, train.micro_batch_size)), step, future)
                scores_all += info["scores"]
                lengths += info["lengths"]
                kept += info["kept"]
                update_features += features
            # fixed or token-budget micro-batches of the generated examples (KTO's KL rows may borrow completions
            # of the update's other examples on this rank); per-unit weights become `weights`
            batches = update_batches(self.collate, update_features, self.engine,
                                     len(update_features) // self.engine.gradient_accumulation_steps,
                                     train.max_tokens_per_micro_batch)
            for batch in batches:
                if self.needs_old_logps:
                    with torch.no_grad():
                        batch["old_logps"] = self.engine.token_logps(batch, "policy", self.logps_temperature).detach()
            self.buffer[future] = batches
        self.cpu_s += time.process_time() - cpu
        metrics.update(
            rollout=True, rollout_time_s=time.perf_counter() - start,
            reward_mean=statistics.fmean(scores_all), reward_std=statistics.pstdev(scores_all),
            gen_len_mean=statistics.fmean(lengths), gen_len_max=float(max(lengths)),
        )
        if kept:
            metrics["pairs_kept_frac"] = statistics.fmean(kept)
        return metrics

    def batches(self, step: int) -> List[dict]:
        """The micro-batches of ``step`` (removed from the buffer)."""
        return self.buffer.pop(step)

    def _sample(self, features_in: List[dict], positions: List[int]):
        """Generate and score one micro-batch's groups: ``(completion ids per prompt, texts, scores)``."""
        scored_prompts, scored_completions, references = [], [], []
        sampled = self.sampler.sample_groups([f["prompt_ids"] for f in features_in], self.cfg.num_generations,
                                             [prompt_seed(self.seed, pos) for pos in positions])
        for feature, completions in zip(features_in, sampled):
            texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            scored_prompts += [feature["messages"]] * len(texts)
            scored_completions += texts
            references += [feature["reference"]] * len(texts)
        return sampled, scored_completions, self.reward(scored_prompts, scored_completions, references)

    def _examples(self, positions: List[int], rollout_step: int, train_step: int):
        """Generate (or replay), score and turn one micro-batch of prompts into objective examples."""
        features_in = [self.prompts[self.positions(pos)] for pos in positions]
        if self.replay is not None:
            sampled, scored_completions, scores = self.replay.groups(rollout_step, train_step, positions, features_in)
        else:
            sampled, scored_completions, scores = self._sample(features_in, positions)
        groups = list(zip(features_in, sampled))
        if self.sample_log is not None:
            n = self.cfg.num_generations
            with self.sample_log.open("a") as fh:
                for g, (pos, (feature, completions)) in enumerate(zip(positions, groups)):
                    fh.write(json.dumps({
                        "rollout_step": rollout_step, "train_step": train_step, "position": pos,
                        "prompt": feature["messages"], "reference": feature["reference"],
                        "completion_ids": completions,
                        "completions": scored_completions[g * n : (g + 1) * n], "scores": scores[g * n : (g + 1) * n],
                    }) + "\n")
        features, kept, lengths = [], [], []
        n = self.cfg.num_generations
        build = EXAMPLE_BUILDERS[self.data_kind]
        if self.data_kind == "grouped" and self.cfg.group == "best_worst":
            build = _best_worst_group_examples
        for g, (feature, completions) in enumerate(groups):
            lengths += [len(c) for c in completions]
            kept += build(features, feature["prompt_ids"], completions, scores[g * n : (g + 1) * n], self.cfg.threshold)
        return features, {"scores": list(scores), "lengths": lengths, "kept": kept}

    # ------------------------------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, object]:
        return {"buffer": {int(k): v for k, v in self.buffer.items()}}

    def load_state_dict(self, state) -> None:
        self.buffer = {int(k): v for k, v in state.get("buffer", {}).items()}


def _group_examples(out: list, prompt_ids, completions, scores, threshold) -> list:
    """GRPO: the prompt's generations are one group."""
    out.append({
        "input_ids": [prompt_ids + c for c in completions],
        "completion_mask": [[0] * len(prompt_ids) + [1] * len(c) for c in completions],
        "scores": list(scores),
    })
    return []


def _best_worst_group_examples(out: list, prompt_ids, completions, scores, threshold) -> list:
    """GRPO, ``rollout.group: best_worst``: the best and worst generations as a group of two; weight 0 unless
    their scores differ by more than ``threshold``."""
    best, worst, keep = best_and_worst(scores, threshold)
    out.append({
        "input_ids": [prompt_ids + completions[i] for i in (best, worst)],
        "completion_mask": [[0] * len(prompt_ids) + [1] * len(completions[i]) for i in (best, worst)],
        "scores": [scores[best], scores[worst]],
        "weight": float(keep),
    })
    return [float(keep)]


def _pair_examples(out: list, prompt_ids, completions, scores, threshold) -> list:
    """DPO: best vs worst generation; weight 0 unless their scores differ by more than ``threshold``."""
    best, worst, keep = best_and_worst(scores, threshold)
    out.append({
        "chosen_input_ids": prompt_ids + completions[best],
        "chosen_completion_mask": [0] * len(prompt_ids) + [1] * len(completions[best]),
        "rejected_input_ids": prompt_ids + completions[worst],
        "rejected_completion_mask": [0] * len(prompt_ids) + [1] * len(completions[worst]),
        "weight": float(keep),
    })
    return [float(keep)]


def _unpaired_examples(out: list, prompt_ids, completions, scores, threshold) -> list:
    """KTO: the same best (desirable) and worst (undesirable) generations, as two examples."""
    best, worst, keep = best_and_worst(scores, threshold)
    for index, desirable in ((best, True), (worst, False)):
        out.append({"prompt_ids": prompt_ids, "completion_ids": completions[index], "desirable": desirable,
                    "max_length": None, "weight": float(keep)})
    return [float(keep)]


EXAMPLE_BUILDERS = {"grouped": _group_examples, "paired": _pair_examples, "unpaired": _unpaired_examples}
