"""Held-out evaluation by reward: one sampled completion per held-out prompt, scored by ``rollout.reward``.

Used by rollout runs (``eval.held_out: auto``) and, with ``eval.held_out: reward``, by offline runs too, so an
offline arm and an online arm are measured the same way. Prompt ``i`` is always sampled under the same seed, so
curves compare across updates and do not depend on the number of ranks.

Besides the mean reward and completion length it reports ``win_rate_vs_start``: per prompt, 1 when the
completion scores higher than the first evaluation's completion of that prompt (the start policy when
``eval.at_start``), 0.5 on a tie, 0 below (the shape of AlpacaEval's win rate against a fixed baseline, under an
exact reward). The first evaluation's scores are kept in ``output_dir/heldout_start_rank<R>.json`` so a resumed
run compares against the same baseline.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ..config.decisions import Sampling
from ..errors import DataError
from .generation import build_sampler, prompt_seed
from .rewards import build_reward, reward_needs_reference

EVAL_SEED_OFFSET = 7919  # held-out samples never share a seed with training rollouts


def win_rate(scores: List[float], baseline: List[float]) -> float:
    """Mean over prompts of ``1[s > b] + 0.5 * 1[s == b]``."""
    if len(scores) != len(baseline):
        raise ValueError(f"{len(scores)} scores against a baseline of {len(baseline)}")
    return statistics.fmean(1.0 if s > b else 0.5 if s == b else 0.0 for s, b in zip(scores, baseline))


def check_prompts_have_references(prompts, kind: str, split: str) -> None:
    """A reward that compares with a reference answer (``math``) needs one on every prompt."""
    if not reward_needs_reference(kind):
        return
    missing = [f for f in prompts.features if f["reference"] is None]
    if missing:
        raise DataError(
            f"`rollout.reward.kind: {kind}` needs a reference answer for every prompt, but {len(missing)} {split} "
            f"prompt(s) have none (first: {missing[0].get('source', 'a row')}). Fix: add `answer` (or a `solution` "
            "with \\boxed{...}) to each row, or use another reward."
        )


class HeldOutReward:
    """Samples and scores the held-out prompts (``sampling``: what generation reads, ``hl_core.config.Sampling``;
    ``output_dir``: the run's, where the first evaluation's scores are kept); ``sampler``/``reward`` are shared with
    the rollout source when there is one (one vLLM engine, one reward model)."""

    METRIC_KEYS = ("reward", "gen_len", "win_rate_vs_start")

    def __init__(self, sampling: Sampling, output_dir: Path, engine, tokenizer, eval_prompts, sampler=None,
                 reward=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.sampler = sampler or build_sampler(engine, tokenizer, sampling)
        self.reward = reward or build_reward(sampling.rollout.reward)
        self.seed = sampling.seed + EVAL_SEED_OFFSET
        check_prompts_have_references(eval_prompts, sampling.rollout.reward.kind, "held-out")
        self.start_file = Path(output_dir) / f"heldout_start_rank{engine.rank:05d}.json"
        self.start_scores: Optional[List[float]] = None

    def _baseline(self, scores: List[float], updates_done: int) -> List[float]:
        """The first evaluation's scores: this one's at update 0 (written), else the file a resumed run kept."""
        if self.start_scores is None:
            if updates_done > 0 and self.start_file.exists():
                self.start_scores = self._read_start(len(scores))
            else:
                self.start_scores = list(scores)
                self.start_file.parent.mkdir(parents=True, exist_ok=True)
                self.start_file.write_text(json.dumps({"update": updates_done, "scores": self.start_scores}))
        return self.start_scores

    def _read_start(self, n_prompts: int) -> List[float]:
        """The first evaluation's scores kept by an earlier run, refused when torn or foreign (not
        ``{"scores": [n_prompts finite numbers]}``)."""
        try:
            kept = json.loads(self.start_file.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError) as exc:
            problem = f"it is not readable JSON ({type(exc).__name__})"
        else:
            scores = kept.get("scores") if isinstance(kept, dict) else None
            numbers = isinstance(scores, list) and all(
                isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)
            if numbers and len(scores) == n_prompts:
                return [float(s) for s in scores]
            shape = (f"{len(scores)} scores" if isinstance(scores, list) else "no `scores` list")
            problem = f"it holds {shape}, not {n_prompts} finite numbers, one per held-out prompt"
        raise DataError(
            f"`{self.start_file}` is damaged: {problem}. It keeps the first held-out evaluation's scores, which "
            "`win_rate_vs_start` compares against after a resume. Fix: restore the file, or delete it to compare "
            "against this evaluation instead (the win rate then restarts at 0.5), or resume with the held-out data "
            "it was written for."
        )

    @torch.no_grad()
    def evaluate(self, eval_prompts, updates_done: int) -> Tuple[Dict[str, float], float]:
        """``(means over this rank's prompts, number of prompts)``; every rank samples equally many rows."""
        engine = self.engine
        n = len(eval_prompts)
        per_rank = -(-n // engine.dp_size)
        mine = [engine.dp_rank * per_rank + i for i in range(per_rank)]
        real = [i for i in mine if i < n]
        self.sampler.push_weights()
        prompts = [eval_prompts[i if i < n else 0]["prompt_ids"] for i in mine]
        completions = [group[0] for group in self.sampler.sample_groups(
            prompts, 1, [prompt_seed(self.seed, i) for i in mine])]
        if not real:
            return {key: 0.0 for key in self.METRIC_KEYS}, 0.0
        texts = self.tokenizer.batch_decode(completions[: len(real)], skip_special_tokens=True)
        scores = [float(s) for s in self.reward([eval_prompts[i]["messages"] for i in real], texts,
                                                [eval_prompts[i]["reference"] for i in real])]
        lengths = [len(c) for c in completions[: len(real)]]
        return {"reward": statistics.fmean(scores), "gen_len": statistics.fmean(lengths),
                "win_rate_vs_start": win_rate(scores, self._baseline(scores, updates_done))}, float(len(real))
