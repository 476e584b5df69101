"""One update's (or one evaluation's) metrics: declared up front, averaged over micro-batches and ranks.

Values may be Python numbers or 0-dim tensors on the device (what the objectives and the humanline transforms
return): they are accumulated as float64 tensors where they live and reach the host once, in ``reduce``'s one
all-reduce. The arithmetic is that of Python floats (each value widened to float64, then ``sum + value * weight``),
so the means are the doubles a host-side accumulation gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Sequence, Tuple, Union

import torch

Number = Union[float, torch.Tensor]


def declared_metric_keys(objective, transform, source_keys: Sequence[str] = ()) -> Tuple[str, ...]:
    """Every metric a micro-batch (or an evaluation) may report, sorted: ``loss``, the objective's
    ``metric_keys``, the humanline transform's and the data source's ``METRIC_KEYS`` (``source_keys``)."""
    return tuple(sorted({"loss", *objective.metric_keys, *transform.METRIC_KEYS, *source_keys}))


def as_float64(value) -> Number:
    """A tensor widened to float64 where it lives (detached), a number as a Python float: ``float(value)``'s
    double without reading the device."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return float(value)


def device_vector(values: Sequence[Number], device: torch.device) -> torch.Tensor:
    """``values`` (numbers and 0-dim tensors) as one float64 vector on ``device``: the numbers in one copy to
    the device, the tensors placed without a host read."""
    host = [0.0 if isinstance(v, torch.Tensor) else float(v) for v in values]
    vector = torch.tensor(host, dtype=torch.float64).to(device)
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    if on_device:
        vector[on_device] = torch.stack([values[i].detach().to(device=device, dtype=torch.float64).reshape(())
                                         for i in on_device])
    return vector


@dataclass
class MetricMeans:
    """Weighted mean of metrics over micro-batches and ranks, per key: a key that only some
    micro-batches report (e.g. KTO's reward of a kind absent from a batch) averages over those, and a
    key no micro-batch of any rank reported is left out. ``keys`` is the fixed, declared set (see
    ``declared_metric_keys``), so ``reduce`` is one all-reduce of a fixed size at any world size;
    reporting a key outside it is an error (``objective`` names the run's objective in that error).
    Weights are host numbers; values may be device tensors (see the module docstring)."""

    keys: Sequence[str]
    objective: str
    sums: Dict[str, Number] = field(default_factory=dict)
    weights: Dict[str, float] = field(default_factory=dict)

    def add(self, metrics: Dict[str, Number], weight: float = 1.0) -> None:
        for key, value in metrics.items():
            if key not in self.keys:
                raise RuntimeError(
                    f"Metric `{key}` was reported but objective `{self.objective}` does not declare it (declared: "
                    f"{', '.join(self.keys)}). Add it to the METRIC_KEYS of whatever reports it: the objective's "
                    "module, the humanline transform or the data source."
                )
            self.sums[key] = self.sums.get(key, 0.0) + as_float64(value) * weight
            self.weights[key] = self.weights.get(key, 0.0) + weight

    def reduce(self, engine, totals: Sequence[Number] = ()) -> Dict[str, float]:
        """The means; with ``totals`` (numbers or device tensors), one reduction also sums those over ranks:
        ``(means, sums)``. The one host read of the update's metrics is this all-reduce's result."""
        keys = self.keys
        local = device_vector([self.sums.get(k, 0.0) for k in keys] + [self.weights.get(k, 0.0) for k in keys]
                              + list(totals), engine.device)
        total = engine.all_reduce_sum(local).tolist()
        n = len(keys)
        means = {k: total[i] / total[n + i] for i, k in enumerate(keys) if total[n + i] > 0}
        return (means, total[2 * n:]) if len(totals) else means
