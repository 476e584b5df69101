"""Per-token log-probs kept in place of a reference model's forward, keyed by the batch they belong to.

Log-probs are stored per forward batch, keyed by the batch's token ids, attention mask and temperature: a batch is
the same batch wherever the data order puts it, and under one set of reference weights its log-probs are the same.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Optional

import torch

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
        returns the number of forwards run. The copies to the host are asynchronous on a GPU: read the values on
        the host only after ``engine.synchronize()`` (the trainer waits at the end of every update). Every rank runs the
        same number (ZeRO-3 / model-parallel forwards are collective): ranks hold the same number of batches of the same
        kinds."""
        forwards = 0
        for batch in batches:
            for forward in forward_batches(batch):
                key = batch_key(forward, temperature)
                if key in self.values:
                    continue
                with engine.policy_as_reference():
                    logps = engine.token_logps(forward, "policy", temperature)
                # an asynchronous copy (pinned memory on a GPU): the trainer's wait at the end of the update orders it
                # before any host read (a checkpoint); the next forward's copy back is ordered on the stream
                self.values[key] = logps.detach().to("cpu", torch.float32, non_blocking=True)
                forwards += 1
        return forwards
