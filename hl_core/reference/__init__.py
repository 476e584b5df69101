"""Where the reference's per-token log-probs come from (``hl_core.config.reference_mode``).

* ``copy`` / ``none``: the engine's reference model (``hl_core.humanline.ReferenceSync`` overwrites it at each sync, or
  mixes the
  policy into it: ``humanline.sync_mix``), or none.
* ``cached`` (``train.cache_reference_logps``, frozen reference, offline data): the policy, before any update,
  computes the log-probs of every batch of the run and of the eval set once; they are stored on disk
  (``cache.py``) and no reference model is built.
* ``lookahead`` (synced reference, offline data): update ``n``'s reference is the policy as it was at the last
  window start before ``n`` (update 0, and every sync). At each window start, after the backward and before the
  optimizer step, the policy (no gradients, eval mode) computes the log-probs of the batches of the updates up
  to and including the next sync, and of the eval set when an evaluation falls in that window. Update 0 and an
  evaluation before any update read the policy itself. Same forward count as a reference copy (plus, once, the last
  window's updates past ``max_steps``, so a run extended to more updates continues exactly), one model less.

The package: ``store.py`` (log-probs keyed by batch), ``sources.py`` (what the trainer reads: the reference model,
or stored log-probs, and look-ahead syncing), ``cache.py`` (the cached frozen reference on disk).
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

from ..humanline.recipe import sync_schedule
from .cache import CacheLocation, cache_location, cached_reference
from .sources import LookaheadReference, ReferenceLogps, StoredReferenceLogps


def build_reference_logps(mode: str, reason: str, humanline, max_steps: int, engine,
                          batches_of_update: Callable[[int], List[dict]],
                          eval_batches: Optional[Callable[[], Iterable[dict]]], eval_at: Callable[[int], bool],
                          cache: Optional[CacheLocation] = None, show_progress: bool = False,
                          bars: bool = False) -> ReferenceLogps:
    """The run's reference log-probs. ``mode`` and ``reason``: ``config.reference_mode``; ``humanline``: the
    recipe's section (the sync schedule); ``batches_of_update(n)``: this rank's micro-batches of update ``n``;
    ``eval_batches()``: its eval batches (None without a loss evaluation); ``eval_at(u)``: an evaluation runs
    after ``u`` updates; ``cache``: where a ``cached`` reference lives (``cache_location``); ``show_progress``: print
    its notices; ``bars``: and a progress bar while it is computed. A cached reference is
    computed (or read) here, so call this before a resume loads the policy's trained weights."""
    if mode == "lookahead":
        return LookaheadReference(engine, reason, humanline, max_steps, batches_of_update, eval_batches, eval_at)
    if mode == "cached":
        return cached_reference(cache, max_steps, engine, reason, batches_of_update, eval_batches, show_progress,
                                bars)
    return ReferenceLogps(engine, mode, reason, sync_schedule(humanline))


__all__ = ["CacheLocation", "LookaheadReference", "ReferenceLogps", "StoredReferenceLogps", "build_reference_logps",
           "cache_location"]
