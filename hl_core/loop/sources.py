"""Where an offline run's micro-batches come from: the seeded data order and the offline source.

The online source (generated completions) is ``hl_core.rollout.RolloutSource``; both answer ``batches(n)``
(this rank's micro-batches of update ``n``) and ``before_step(n)`` (metrics of work done before it).
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from ..data.build import takes_donors
from .micro_batches import check_budget_fits, update_batches


class DataOrder:
    """Position in the endless data stream -> example index: epoch ``e`` is a permutation seeded by
    ``seed + e`` (or the identity without shuffling). Positions are global over ranks and updates, so a
    resumed run continues exactly where it stopped."""

    def __init__(self, num_examples: int, seed: int, shuffle: bool):
        self.num_examples, self.seed, self.shuffle = num_examples, seed, shuffle
        self._epoch, self._perm = -1, None

    def __call__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_examples)
        if epoch != self._epoch:
            self._epoch = epoch
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(self.num_examples, generator=gen).tolist()
            else:
                self._perm = list(range(self.num_examples))
        return self._perm[offset]


class OfflineSource:
    """Micro-batches from the (tokenized) offline data set, in the seeded data order: the rank's units of the
    update, fixed or by token budget (``micro_batches``)."""

    METRIC_KEYS = ()  # before_step reports nothing

    def __init__(self, engine, micro_batch_size: int, dataset, order: DataOrder, budget: Optional[int] = None):
        self.engine, self.micro, self.dataset, self.order = engine, micro_batch_size, dataset, order
        self.budget = budget
        check_budget_fits(budget, dataset, "example")

    def before_step(self, step: int) -> Dict[str, float]:
        return {}

    def batches(self, step: int) -> List[dict]:
        engine = self.engine
        own = [p for m in range(engine.gradient_accumulation_steps)
               for p in engine.micro_batch_positions(step, m, self.micro)]
        others = []
        if takes_donors(self.dataset.collate):
            # the update's other examples (all ranks): KTO pairs a prompt with another prompt's completion
            per_update = engine.gradient_accumulation_steps * engine.dp_size * self.micro
            mine = set(own)
            others = [self.dataset[self.order(p)] for p in range(step * per_update, (step + 1) * per_update)
                      if p not in mine]
        features = [self.dataset[self.order(p)] for p in own]
        return update_batches(self.dataset.collate, features, engine, self.micro, self.budget, others)
