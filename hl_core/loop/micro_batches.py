"""How one optimizer update's examples become micro-batches, and how their losses and metrics combine.

An update always covers the same examples: this rank's ``gradient_accumulation_steps x micro_batch_size``
units of update ``n`` in the seeded data order (a *unit* is what must stay together: a DPO pair, a KTO
example, a whole GRPO prompt group, an SFT row). They are split into micro-batches either

* fixed: consecutive chunks of ``train.micro_batch_size`` units (``gradient_accumulation_steps`` of them), or
* by token budget (``train.max_tokens_per_micro_batch``): first-fit decreasing by the unit's real tokens
  (ties broken by position, so the split is deterministic given the seed), bins of at most the budget.
  A unit's cost is the real (non-pad) tokens of the rows its gradient forward sees: DPO chosen + rejected,
  a KTO example's row (its KL row goes through a separate no-grad pass over the same bins), every row of a
  GRPO group, an SFT row.

Every rank runs as many forward/backward passes (ZeRO-3 gathers and gradient reductions are collective): a
rank with fewer bins adds dummy micro-batches (``batch["dummy"]``) whose loss is multiplied by 0.

The update's loss does not depend on the split. Each objective's micro-batch loss is a mean over its
``share`` (pairs or examples, weighted; completion tokens; sequences: ``ObjectiveSpec.loss_share``); the
trainer scales micro-batch ``m`` by ``share_m / D``, ``D`` = the rank's total share (or, for GRPO's
``dapo``, the share summed over ranks / world size), so the gradient is that of one mean over the update.
Metrics are weighted likewise (``ObjectiveSpec.metric_weights``; counts summed per rank; statistics of the
whole update from ``prepare_update``), so they too are independent of the split. The reported ``loss`` is
the rank's update loss (the mean over ranks of what each rank's gradient is of). Not split-independent:
``humanline.transform: sample``, whose rejection bound ``M`` is a maximum over the micro-batch (the method's
definition), and its random draws.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..data.build import collate_micro_batches, takes_donors
from ..errors import RecipeError
from .metrics import as_float64


def unit_tokens(feature: dict) -> int:
    """Real tokens of one unit: every row its gradient forward sees (see the module docstring)."""
    total = 0
    for key in ("input_ids", "chosen_input_ids", "rejected_input_ids", "prompt_ids", "completion_ids"):
        value = feature.get(key)
        if value is None:
            continue
        total += sum(len(row) for row in value) if value and isinstance(value[0], (list, tuple)) else len(value)
    return total


def fixed_bins(count: int, micro_batch_size: int) -> List[List[int]]:
    """Consecutive chunks of ``micro_batch_size`` positions (the last may be shorter)."""
    return [list(range(start, min(count, start + micro_batch_size))) for start in range(0, count, micro_batch_size)]


def plan_bins(costs: Sequence[int], budget: int) -> List[List[int]]:
    """First-fit decreasing: units by cost, largest first (ties: earlier position first), each into the first
    bin with room, else a new bin. Returns bins of positions (ascending within a bin; bins in order of
    creation). Every position appears exactly once and no bin exceeds ``budget``; a unit over budget is a
    ``ValueError`` (the recipe checks make that impossible)."""
    bins: List[List[int]] = []
    loads: List[int] = []
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        cost = costs[index]
        if cost > budget:
            raise ValueError(f"unit {index} has {cost} tokens, over the budget of {budget}")
        for b, load in enumerate(loads):
            if load + cost <= budget:
                bins[b].append(index)
                loads[b] += cost
                break
        else:
            bins.append([index])
            loads.append(cost)
    return [sorted(b) for b in bins]


def check_budget_fits(budget: Optional[int], dataset, noun: str) -> None:
    """Every unit of ``dataset`` fits in ``budget`` tokens (the recipe check bounds rows by ``data.max_length``;
    an offline GRPO group's size comes from the data); else a ``RecipeError`` naming the key."""
    if budget is None or not len(dataset):
        return

    largest = max(range(len(dataset)), key=lambda i: unit_tokens(dataset[i]))
    tokens = unit_tokens(dataset[largest])
    if tokens > budget:
        raise RecipeError(
            f"`train.max_tokens_per_micro_batch: {budget}` cannot hold {noun} {largest} of the training data ({tokens} "
            f"tokens); nothing is cut or dropped to fit a budget. Fix: `train.max_tokens_per_micro_batch={tokens}` or "
            "more, or lower `data.max_length`."
        )


def max_over_ranks(engine, value: int) -> int:
    """The largest ``value`` of any rank (one all-reduce of ``world_size`` numbers)."""
    if engine.world_size <= 1:
        return int(value)
    slots = torch.zeros(engine.world_size, dtype=torch.float64)
    slots[engine.rank] = float(value)
    return int(engine.all_reduce_sum(slots).max().item())


def collate_bins(collate: Callable, features: List[dict], bins: List[List[int]],
                 more: Sequence[dict] = ()) -> List[dict]:
    """One batch per bin. A collate function that borrows (``donors``: KTO's KL rows) and takes ``rows`` pairs
    over the whole update (``features``, then ``more``: other ranks' examples), so a KL row does not depend
    on the split; one without ``rows`` gets the other bins' units (the next one first) then ``more``."""
    if takes_donors(collate) and "rows" in inspect.signature(collate).parameters:
        return [collate(features, donors=list(more), rows=b) for b in bins]
    return collate_micro_batches(collate, [[features[i] for i in b] for b in bins], more)


def update_batches(collate: Callable, features: List[dict], engine, micro_batch_size: int,
                   budget: Optional[int], more: Sequence[dict] = ()) -> List[dict]:
    """This rank's micro-batches of one update (``features``: its units in data order), fixed or by token
    budget, padded with dummy micro-batches to the largest bin count of any rank. Per-unit ``weight`` values
    (online pairs and groups) become ``batch["weights"]``."""
    if budget is None:
        bins = fixed_bins(len(features), micro_batch_size)
    else:
        bins = plan_bins([unit_tokens(f) for f in features], budget)
    batches = collate_bins(collate, features, bins, more)
    if features and "weight" in features[0]:
        for b, batch in zip(bins, batches):
            batch["weights"] = torch.tensor([features[i]["weight"] for i in b], dtype=torch.float32)
    count = len(batches) if budget is None else max_over_ranks(engine, len(batches))
    smallest = min(range(len(batches)), key=lambda i: int(batches[i]["attention_mask"].numel()))
    while len(batches) < count:
        batches.append({**batches[smallest], "dummy": True})
    return batches


# -------------------------------------------------------------------------------------------- the update
@dataclass
class UpdateNormaliser:
    """Loss factors and metric accumulation of one update (see the module docstring).

    ``factors[m]``: what micro-batch ``m``'s mean loss is multiplied by before the engine's backward (which
    divides by ``gradient_accumulation_steps``); ``add`` takes micro-batch ``m``'s loss and metrics;
    ``finish(acc)`` hands the rank's weighted sums to the trainer's accumulator."""

    spec: object
    cfg: object
    batches: List[dict]
    engine: object
    extra_weight_keys: Sequence[str] = ()  # the humanline transform's metrics: fractions of completion tokens
    factors: List[float] = field(default_factory=list)
    shares: List[float] = field(default_factory=list)
    update_metrics: Dict[str, float] = field(default_factory=dict)
    _parts: Dict[str, Tuple[object, float]] = field(default_factory=dict)  # (sum of value x weight, weights)
    _sums: Dict[str, object] = field(default_factory=dict)
    _loss: object = 0.0

    def prepare(self, token_logps: Callable, transform: Callable) -> None:
        spec, cfg = self.spec, self.cfg
        if spec.prepare_update is not None:
            self.update_metrics = spec.prepare_update(cfg, self.batches, token_logps, transform) or {}
        shares = [0.0 if b.get("dummy") else float(spec.loss_share(cfg, b)) for b in self.batches]
        total = sum(shares)
        if spec.share_scope(cfg) == "world":
            summed = self.engine.all_reduce_sum(torch.tensor([total], dtype=torch.float64))[0].item()
            total = summed / self.engine.world_size
        self.shares = [s / total if total > 0 else 0.0 for s in shares]
        accumulation = self.engine.gradient_accumulation_steps
        self.factors = [s * accumulation for s in self.shares]

    def scaled(self, m: int, loss: torch.Tensor) -> torch.Tensor:
        factor = self.factors[m]
        return loss if factor == 1.0 else loss * factor

    def add(self, m: int, loss, metrics: Dict[str, object]) -> None:
        """Micro-batch ``m``'s loss and metrics: numbers or device tensors, accumulated as float64 where they live
        (no host read; ``hl_core.loop.metrics``). The weights come from the collated batch, on the host."""
        batch = self.batches[m]
        if batch.get("dummy"):
            return
        self._loss = self._loss + self.shares[m] * as_float64(loss)
        weights = self.spec.metric_weights(self.cfg, batch)
        tokens = float(batch["completion_mask"].sum())
        for key, value in metrics.items():
            if key in self.update_metrics:
                continue
            weight = weights.get(key, tokens if key in self.extra_weight_keys else 1.0)
            if weight is None:  # a count: summed over the rank's micro-batches
                self._sums[key] = self._sums.get(key, 0.0) + as_float64(value)
                continue
            numerator, denominator = self._parts.get(key, (0.0, 0.0))
            self._parts[key] = (numerator + as_float64(value) * weight, denominator + weight)

    def finish(self, acc) -> None:
        """Into ``acc`` (the trainer's ``_Accumulator``): the rank's loss, counts and update statistics with
        weight 1 (a mean over ranks, as each rank's gradient counts once), the rest with their weights."""
        acc.add({"loss": self._loss, **self._sums, **self.update_metrics})
        for key, (numerator, denominator) in self._parts.items():
            if denominator > 0:
                acc.add({key: numerator / denominator}, weight=denominator)


def finish_metrics(spec, means: Dict[str, float]) -> Dict[str, float]:
    """Metrics derived from reduced ones (e.g. SFT's perplexity from the mean NLL)."""
    return spec.finish_metrics(means) if spec.finish_metrics is not None else means
