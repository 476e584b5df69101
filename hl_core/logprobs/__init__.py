"""Per-token log-probabilities: the math between a model's output and the objectives' inputs.

* ``logits.py``: from logits, chunked over the sequence so no ``[B, T, V]`` float32 copy exists; the
  vocab-parallel form for Megatron; the masked mean.
* ``packed.py``: padding-free forwards, several sequences per row, log-probs returned in the padded layout.

The names below are the package's interface; engines, eval and tests import them from here. Three of them are
public, re-exported by ``hl_core.humanline`` for your own loop: ``prefix_token_logps`` (from logits),
``fused_sequence_token_logps`` (from the hidden states) and ``mask_from_labels``.
"""

from .hidden import fused_sequence_token_logps
from .logits import (
    DEFAULT_CHUNK,
    chunk_positions,
    mask_from_labels,
    masked_mean,
    prefix_token_logps,
    sequence_token_logps,
    token_logps,
    vocab_parallel_logps,
)

__all__ = ["DEFAULT_CHUNK", "chunk_positions", "fused_sequence_token_logps", "mask_from_labels", "masked_mean",
           "prefix_token_logps", "sequence_token_logps", "token_logps", "vocab_parallel_logps"]
