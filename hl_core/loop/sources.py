"""Where an offline run's micro-batches come from: the seeded data order (one source, or a weighted mixture), how
many updates ``train.epochs`` makes, and the offline source.

The online source (generated completions) is ``hl_core.rollout.RolloutSource``; both answer ``batches(n)``
(this rank's micro-batches of update ``n``) and ``before_step(n)`` (metrics of work done before it).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..data.build import takes_donors
from ..errors import RecipeError
from .micro_batches import check_budget_fits, update_batches

MIXTURE_BLOCK = 10_000  # positions per block of a mixture's stream (each source gets its share of every block)
SOURCE_SEED_STRIDE = 2**34  # source s of a mixture orders its examples with seed + s * stride (source 0: seed)
BLOCK_SEED_OFFSET = 2**33  # block b's layout is drawn with seed + offset + b (beyond every per-pass seed)


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


def block_quotas(weights: Sequence[float], block: int = MIXTURE_BLOCK) -> List[int]:
    """Each source's positions in one block: largest-remainder rounding of ``block`` x its normalised weight
    (ties to the earlier source); every source gets at least one (else ``RecipeError`` naming the weight)."""
    total = sum(weights)
    exact = [w * block / total for w in weights]
    quotas = [math.floor(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (quotas[i] - exact[i], i))[: block - sum(quotas)]:
        quotas[i] += 1
    for i, quota in enumerate(quotas):
        if quota == 0:
            raise RecipeError(f"`data.train[{i}].weight` ({weights[i]:g}) gives that source no draw in {block} "
                              "examples. Fix: raise its weight, or drop the source.")
    return quotas


class MixtureOrder:
    """Position -> example index for a weighted mixture of sources, source ``s`` holding the indices
    ``[starts[s], starts[s] + sizes[s])`` of the joined dataset.

    The stream is cut into blocks of ``MIXTURE_BLOCK`` positions; each block holds source ``s`` exactly
    ``quotas[s]`` times (``block_quotas``), laid out in a random order drawn with ``seed + BLOCK_SEED_OFFSET + b``
    (without shuffling: evenly spread, source ``s``'s ``j``-th slot at ``(j + 1/2) / quotas[s]`` of the block). The
    ``k``-th draw of source ``s`` overall (``k = b * quotas[s]`` + its draws earlier in block ``b``) is position ``k``
    of the source's own endless ``DataOrder`` (a permutation per pass, seeded ``seed + s * SOURCE_SEED_STRIDE``), so
    a source repeats an example only after drawing all of them. A pure function of the position: resumes are exact,
    and a one-source mixture is the one-source order."""

    def __init__(self, parts: Sequence[Tuple[int, int]], weights: Sequence[float], seed: int, shuffle: bool,
                 block: int = MIXTURE_BLOCK):
        self.starts = [start for start, _ in parts]
        self.orders = [DataOrder(size, seed + s * SOURCE_SEED_STRIDE, shuffle) for s, (_, size) in enumerate(parts)]
        self.quotas, self.block, self.seed, self.shuffle = block_quotas(weights, block), block, seed, shuffle
        self._blocks: Dict[int, Tuple[List[int], List[int]]] = {}  # block -> (source, its draws before) per slot

    def _layout(self, b: int) -> Tuple[List[int], List[int]]:
        if b not in self._blocks:
            labels = torch.cat([torch.full((q,), s, dtype=torch.long) for s, q in enumerate(self.quotas)])
            if self.shuffle:
                labels = labels[torch.randperm(self.block, generator=torch.Generator().manual_seed(
                    self.seed + BLOCK_SEED_OFFSET + b))]
            else:
                spread = torch.cat([(torch.arange(q, dtype=torch.float64) + 0.5) / q for q in self.quotas])
                labels = labels[torch.argsort(spread, stable=True)]
            before = torch.empty_like(labels)
            for s in range(len(self.quotas)):
                mine = labels == s
                before[mine] = torch.arange(int(mine.sum()))
            if len(self._blocks) >= 2:  # positions move forward; an update may straddle two blocks
                self._blocks.pop(min(self._blocks))
            self._blocks[b] = (labels.tolist(), before.tolist())
        return self._blocks[b]

    def __call__(self, position: int) -> int:
        b, offset = divmod(position, self.block)
        labels, before = self._layout(b)
        s = labels[offset]
        return self.starts[s] + self.orders[s](b * self.quotas[s] + before[offset])


def data_order(dataset, seed: int, shuffle: bool):
    """The dataset's order: ``DataOrder``, or ``MixtureOrder`` for a mixture (``dataset.parts``)."""
    parts = getattr(dataset, "parts", None)
    if not parts:
        return DataOrder(len(dataset), seed, shuffle)
    return MixtureOrder([(p.start, p.stats.examples) for p in parts], [p.weight for p in parts], seed, shuffle)


def updates_for_epochs(epochs: float, num_examples: int, per_update: int) -> int:
    """``ceil(epochs x num_examples / per_update)`` in exact arithmetic (``epochs`` as written: 0.1 is 1/10)."""
    return max(1, math.ceil(Fraction(repr(float(epochs))) * num_examples / per_update))


def epoch_steps(train_cfg, num_examples: int, dp_size: int, accumulation: int) -> Tuple[int, str]:
    """``train.epochs`` as updates, and the line that says how (``train_cfg``: the recipe's ``train`` section)."""
    micro, epochs = train_cfg.micro_batch_size, train_cfg.epochs
    per_update = micro * accumulation * dp_size
    steps = updates_for_epochs(epochs, num_examples, per_update)
    extra = steps * per_update - Fraction(repr(float(epochs))) * num_examples
    tail = (f"the last update takes {math.ceil(extra)} example(s) from the next pass of the data order" if extra
            else "no partial batch")
    return steps, (f"`train.epochs: {epochs:g}` -> `train.max_steps: {steps}` = ceil({epochs:g} x {num_examples} "
                   f"examples / {per_update} per update (micro-batch {micro} x accumulation {accumulation} x "
                   f"data-parallel {dp_size})); {tail}")


class OfflineSource:
    """Micro-batches from the (tokenized) offline data set, in the seeded data order: the rank's units of the
    update, fixed or by token budget (``micro_batches``)."""

    METRIC_KEYS = ()  # before_step reports nothing
    cpu_s = 0.0  # no rollouts: no rollout CPU time (the summary's `rollout_cpu_s`)

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
