"""One update's (or one evaluation's) metrics: declared up front, averaged over micro-batches and ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence, Tuple

import torch


def declared_metric_keys(objective, transform, source_keys: Sequence[str] = ()) -> Tuple[str, ...]:
    """Every metric a micro-batch (or an evaluation) may report, sorted: ``loss``, the objective's
    ``metric_keys``, the humanline transform's and the data source's ``METRIC_KEYS`` (``source_keys``)."""
    return tuple(sorted({"loss", *objective.metric_keys, *transform.METRIC_KEYS, *source_keys}))


@dataclass
class MetricMeans:
    """Weighted mean of metrics over micro-batches and ranks, per key: a key that only some
    micro-batches report (e.g. KTO's reward of a kind absent from a batch) averages over those, and a
    key no micro-batch of any rank reported is left out. ``keys`` is the fixed, declared set (see
    ``declared_metric_keys``), so ``reduce`` is one all-reduce of a fixed size at any world size;
    reporting a key outside it is an error (``objective`` names the run's objective in that error)."""

    keys: Sequence[str]
    objective: str
    sums: Dict[str, float] = field(default_factory=dict)
    weights: Dict[str, float] = field(default_factory=dict)

    def add(self, metrics: Dict[str, float], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            if key not in self.keys:
                raise RuntimeError(
                    f"Metric `{key}` was reported but objective `{self.objective}` does not declare it (declared: "
                    f"{', '.join(self.keys)}). Add it to the METRIC_KEYS of whatever reports it: the objective's "
                    "module, the humanline transform or the data source."
                )
            self.sums[key] = self.sums.get(key, 0.0) + float(value) * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def reduce(self, engine, totals: Sequence[float] = ()) -> Dict[str, float]:
        """The means; with ``totals``, one reduction also sums those numbers over ranks: ``(means, sums)``."""
        keys = self.keys
        local = torch.tensor([self.sums.get(k, 0.0) for k in keys] + [self.weights.get(k, 0.0) for k in keys]
                             + [float(v) for v in totals], dtype=torch.float64)
        total = engine.all_reduce_sum(local)
        n = len(keys)
        means = {k: total[i].item() / total[n + i].item() for i, k in enumerate(keys) if total[n + i].item() > 0}
        return (means, total[2 * n:].tolist()) if len(totals) else means
