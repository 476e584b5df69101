"""Where the reference's per-token log-probs come from (``objectives.reference_mode``).

* ``copy`` / ``none``: the engine's reference model (``ReferenceSyncHook`` overwrites it at each sync), or none.
* ``cached`` (``train.cache_reference_logps``, frozen reference, offline data): the policy, before any update,
  computes the log-probs of every batch of the run and of the eval set once; they are stored on disk
  (``hl_core.reference_cache``) and no reference model is built.
* ``lookahead`` (synced reference, offline data): update ``n``'s reference is the policy as it was at the last
  window start before ``n`` (update 0, and every sync). At each window start, after the backward and before the
  optimizer step, the policy (no gradients, eval mode) computes the log-probs of the batches of the updates up
  to and including the next sync, and of the eval set when an evaluation falls in that window. Update 0 and an
  evaluation before any update read the policy itself. Same forward count as a reference copy, one model less.

Log-probs are stored per forward batch, keyed by the batch's token ids (and temperature): a batch is the same
batch wherever the data order puts it, and under one set of reference weights its log-probs are the same.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import torch

from .checkpoint_files import reference_logps_file, safe_load
from .humanline import ReferenceSyncHook, SyncRecord, should_sync

# the (ids, mask) pairs of a collated batch that the reference is asked for: the rows themselves, and KTO's
# mismatched KL rows (``objectives.kto``)
FORWARD_FIELDS = (("input_ids", "attention_mask"), ("kl_input_ids", "kl_attention_mask"))


def forward_batches(batch: Dict[str, torch.Tensor]) -> List[Dict[str, torch.Tensor]]:
    """The forward batches of one collated micro-batch the reference is asked for."""
    return [{"input_ids": batch[ids], "attention_mask": batch[mask]} for ids, mask in FORWARD_FIELDS if ids in batch]


def batch_key(batch: Dict[str, torch.Tensor], temperature: float) -> str:
    """A digest of a forward batch's token ids, attention mask and the log-prob temperature."""
    digest = hashlib.blake2b(digest_size=16)
    ids = batch["input_ids"].detach().to("cpu", torch.int64).contiguous()
    mask = batch["attention_mask"].detach().to("cpu", torch.int64).contiguous()
    digest.update(repr((tuple(ids.shape), float(temperature))).encode())
    digest.update(ids.numpy().tobytes())
    digest.update(mask.numpy().tobytes())
    return digest.hexdigest()


def forward_is_deterministic(module: torch.nn.Module) -> bool:
    """No dropout is active in training mode (no ``Dropout`` with p > 0, no ``*dropout*`` > 0 in the model's
    config): the policy's training forward then equals the eval-mode forward a reference runs."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return False
    config = getattr(module, "config", None)
    values = vars(config).items() if config is not None and hasattr(config, "__dict__") else ()
    return not any("dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
                   for k, v in values)


class LogpStore:
    """Per-token log-probs ``[B, T]`` (float32, CPU) by ``batch_key``."""

    def __init__(self, values: Optional[Dict[str, torch.Tensor]] = None):
        self.values: Dict[str, torch.Tensor] = dict(values or {})

    def get(self, batch, temperature: float) -> Optional[torch.Tensor]:
        return self.values.get(batch_key(batch, temperature))

    def fill(self, engine, batches: Iterable[dict], temperature: float) -> int:
        """Compute (with the policy as the reference) every forward batch of ``batches`` not stored yet;
        returns the number of forwards run. Every rank runs the same number (ZeRO-3 / model-parallel forwards
        are collective): ranks hold the same number of batches of the same kinds."""
        forwards = 0
        for batch in batches:
            for forward in forward_batches(batch):
                key = batch_key(forward, temperature)
                if key in self.values:
                    continue
                with engine.policy_as_reference():
                    logps = engine.token_logps(forward, "policy", temperature)
                self.values[key] = logps.detach().to("cpu", torch.float32)
                forwards += 1
        return forwards


class ReferenceLogps:
    """The engine's reference model (``copy``), or none (``none``); the base of the copy-free modes.

    ``logps(batch, temperature, policy_logps)`` serves the trainer, ``token_logps(batch, model)`` the objectives'
    extra forwards (KTO's KL rows), and ``sync_hook.before_optimizer_step(engine, n)`` runs at every update."""

    def __init__(self, engine, mode: str, reason: str, sync_every: Optional[int], sync_offset: int):
        self.engine, self.mode, self.reason = engine, mode, reason
        self.sync_hook = ReferenceSyncHook(sync_every, sync_offset)

    @property
    def available(self) -> bool:
        return self.engine.has_reference

    def logps(self, batch, temperature: float = 1.0, policy_logps: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.engine.token_logps(batch, "reference", temperature)

    def token_logps(self, batch, model: str = "policy", temperature: float = 1.0) -> torch.Tensor:
        if model == "reference":
            return self.logps(batch, temperature)
        return self.engine.token_logps(batch, model, temperature)

    def state_dict(self) -> Optional[dict]:
        return None  # nothing beyond the engine's own checkpoint

    def load_state_dict(self, state: dict) -> None:
        pass

    def resume(self, checkpoint, rank: int) -> Optional[str]:
        """After the engine loaded ``checkpoint``: restore what this mode keeps; a notice when the checkpoint was
        written in another mode (e.g. ``train.on_nonfinite: skip`` chose a copy after a look-ahead run stopped)."""
        if getattr(self.engine, "resynced_at_resume", False):
            return ("The checkpoint was written with look-ahead syncing and keeps no reference copy; this run keeps "
                    f"one ({self.reason}). It starts from the policy's weights at the resume: one extra sync there.")
        return None


class StoredReferenceLogps(ReferenceLogps):
    """Log-probs the policy computed in place of a reference model, looked up by batch."""

    def __init__(self, engine, mode: str, reason: str, store: Optional[LogpStore] = None):
        super().__init__(engine, mode, reason, None, 0)
        self.store = store or LogpStore()
        self.policy_is_reference = False  # before the first optimizer step (look-ahead): read the policy itself
        self.detach_is_exact = forward_is_deterministic(engine._policy_module())

    @property
    def available(self) -> bool:
        return True

    def logps(self, batch, temperature: float = 1.0, policy_logps: Optional[torch.Tensor] = None) -> torch.Tensor:
        stored = self.store.get(batch, temperature)
        if stored is not None:
            return stored.to(self.engine.device)
        if self.policy_is_reference:
            if policy_logps is not None and self.detach_is_exact:
                return policy_logps.detach()  # the reference's weights are the policy's: no extra forward
            with self.engine.policy_as_reference():
                return self.engine.token_logps(batch, "policy", temperature)
        raise RuntimeError(
            f"No reference log-probs were kept for this batch (reference mode `{self.mode}`): the batches this "
            "run trains or evaluates on differ from the ones computed ahead. This is a bug in hl_core; as a "
            "workaround set `humanline.reference=copy` (or `train.cache_reference_logps=false`)."
        )


class LookaheadReference(StoredReferenceLogps):
    """Look-ahead syncing: ``sync_hook`` is this object; at each window start it replaces the stored log-probs
    with the policy's for the batches up to the next sync (see the module docstring)."""

    def __init__(self, engine, reason: str, recipe, batches_of_update: Callable[[int], List[dict]],
                 eval_batches: Optional[Callable[[], Iterable[dict]]], eval_at: Callable[[int], bool]):
        super().__init__(engine, "lookahead", reason)
        self.sync_hook = self
        hl = recipe.humanline
        self.sync_every, self.offset, self.max_steps = hl.sync_every, hl.sync_offset, recipe.train.max_steps
        self.batches_of_update, self.eval_batches, self.eval_at = batches_of_update, eval_batches, eval_at
        self.policy_is_reference = True  # until update 0's optimizer step (a resume loads its state instead)

    def window_end(self, start: int) -> int:
        """The next sync after ``start``: the last update whose forward reads ``start``'s weights."""
        n = start + 1
        while not should_sync(n, self.sync_every, self.offset):
            n += 1
        return n

    def before_optimizer_step(self, engine, updates_done: int) -> SyncRecord:
        synced = should_sync(updates_done, self.sync_every, self.offset)
        if not (synced or updates_done == 0 or self.policy_is_reference):  # a window starts at 0 or a resume
            return SyncRecord(False, 0.0)
        engine.synchronize()
        start = time.perf_counter()
        end = self.window_end(updates_done)
        self.store = LogpStore()
        updates = range(updates_done + 1, min(end, self.max_steps - 1) + 1)
        self.store.fill(engine, (b for m in updates for b in self.batches_of_update(m)), 1.0)
        evals = [u for u in range(updates_done + 1, min(end, self.max_steps) + 1) if self.eval_at(u)]
        if evals and self.eval_batches is not None:
            self.store.fill(engine, self.eval_batches(), 1.0)
        self.policy_is_reference = False
        engine.synchronize()
        return SyncRecord(synced, time.perf_counter() - start)

    def state_dict(self) -> dict:
        return {"values": self.store.values, "policy_is_reference": torch.tensor(self.policy_is_reference)}

    def load_state_dict(self, state: dict) -> None:
        self.store = LogpStore(state["values"])
        self.policy_is_reference = bool(state["policy_is_reference"])

    def resume(self, checkpoint, rank: int) -> Optional[str]:
        path = Path(checkpoint) / reference_logps_file(rank)
        if path.exists():
            self.load_state_dict(safe_load(path))
            return None
        self.store, self.policy_is_reference = LogpStore(), True  # a new window starts at the resume
        return ("The checkpoint keeps a reference copy, not look-ahead log-probs; this run syncs by look-ahead: "
                "its reference starts from the policy's weights at the resume (one extra sync there).")


def build_reference_logps(recipe, engine, batches_of_update: Callable[[int], List[dict]],
                          eval_batches: Optional[Callable[[], Iterable[dict]]], eval_at: Callable[[int], bool],
                          show_progress: bool = False) -> ReferenceLogps:
    """The run's reference log-probs (``objectives.reference_mode``). ``batches_of_update(n)``: this rank's
    micro-batches of update ``n``; ``eval_batches()``: its eval batches (None without a loss evaluation);
    ``eval_at(u)``: an evaluation runs after ``u`` updates. A cached reference is computed (or read) here, so
    call this before a resume loads the policy's trained weights."""
    from .objectives import reference_mode

    mode, reason = reference_mode(recipe)
    if mode == "lookahead":
        return LookaheadReference(engine, reason, recipe, batches_of_update, eval_batches, eval_at)
    if mode == "cached":
        return cached_reference(recipe, engine, reason, batches_of_update, eval_batches, show_progress)
    return ReferenceLogps(engine, mode, reason, recipe.humanline.sync_every, recipe.humanline.sync_offset)


def cached_reference(recipe, engine, reason: str, batches_of_update, eval_batches, show_progress: bool):
    """Every batch's reference log-probs, computed by the untrained policy (sharded: each rank its own
    batches) or read from ``<output_dir>/reference_cache`` (``hl_core.reference_cache``)."""
    from .reference_cache import ReferenceCacheDir, fingerprint, load_or_compute, update_parts

    fields = fingerprint(recipe, engine.world_size, engine.dp_size, engine.gradient_accumulation_steps)
    cache = ReferenceCacheDir(Path(recipe.output_dir) / "reference_cache" / f"rank{engine.rank:05d}", fields)
    shown = len(cache.notices)  # the fingerprint's notice before the precompute, a torn part's after it
    for notice in cache.notices if show_progress else ():
        print(notice, flush=True)
    parts, units = [], []
    for first, last in update_parts(recipe.train.max_steps):
        parts.append((f"updates-{first:06d}-{last:06d}",
                      lambda a=first, b=last: [x for m in range(a, b + 1) for x in batches_of_update(m)]))
        units.append(last - first + 1)
    if eval_batches is not None:
        parts.append(("eval", lambda: list(eval_batches())))
        units.append(0)
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=recipe.train.max_steps, desc="reference log-probs", unit="update", dynamic_ncols=True)
    try:
        store = load_or_compute(engine, cache, parts, units, 1.0, bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for notice in cache.notices[shown:] if show_progress else ():
        print(notice, flush=True)
    return StoredReferenceLogps(engine, "cached", reason, store)
