"""Padding-free forwards: the rows of a right-padded micro-batch packed into as few bins as fit a token capacity.

Each sequence keeps its own positions (``0 .. len - 1``), and attention never crosses a sequence boundary:
transformers builds a block-causal mask from ``position_ids`` when ``attention_mask`` is None (a position that
does not follow its predecessor by one starts a new sequence), for eager, sdpa and flex attention, and
flash-attention takes its variable-length path from the same ``position_ids``. Per-token log-probs come back in
the padded ``[rows, T]`` layout the objectives consume (``unpack_token_logps``), so no objective changes.

Bins are filled first-fit in decreasing length (ties by row index): deterministic for a given batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .hidden import logps_from_hidden, next_token_labels, to_prefix_layout, valid_positions
from .logits import chunk_positions, prefix_token_logps


def first_fit_bins(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Row indices grouped into bins whose lengths sum to at most ``capacity``: rows in decreasing length (ties
    by index), each into the first bin with room, else a new bin. A row longer than ``capacity`` is a
    ``ValueError`` (truncation to ``data.max_length`` happens before)."""
    if capacity < 1:
        raise ValueError(f"bin capacity must be positive, got {capacity}")
    too_long = [i for i, n in enumerate(lengths) if n > capacity]
    if too_long:
        raise ValueError(f"row {too_long[0]} has {lengths[too_long[0]]} tokens, more than the bin capacity {capacity}")
    bins: List[List[int]] = []
    room: List[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, free in enumerate(room):
            if lengths[row] <= free:
                bins[b].append(row)
                room[b] -= lengths[row]
                break
        else:
            bins.append([row])
            room.append(capacity - lengths[row])
    return bins


@dataclass
class Packed:
    """A packed micro-batch: ``input_ids`` / ``position_ids`` ``[bins, width]``, and where each original row lies
    (``places[row] = (bin, offset, length)``) in a batch of ``shape`` = ``(rows, T)``."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    places: List[Tuple[int, int, int]]
    shape: Tuple[int, int]

    @property
    def real_tokens(self) -> int:
        return sum(length for _, _, length in self.places)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, capacity: int, pad_token_id: int) -> Packed:
    """Pack the right-padded rows of ``input_ids`` (real tokens where ``attention_mask`` is 1) into bins of at
    most ``capacity`` tokens. A bin's unused tail holds ``pad_token_id`` with positions restarting at 0, so it
    is a separate sequence that nothing real attends to. The width is the fullest bin's length."""
    lengths = attention_mask.sum(dim=1).tolist()
    if any(int(attention_mask[r, :n].min()) == 0 for r, n in enumerate(lengths) if n):
        raise ValueError("pack_rows needs right-padded rows (ones, then zeros, in attention_mask)")
    bins = first_fit_bins([int(n) for n in lengths], capacity)
    width = max(sum(lengths[r] for r in rows) for rows in bins)
    ids = input_ids.new_full((len(bins), width), pad_token_id)
    positions = torch.zeros((len(bins), width), dtype=torch.long, device=input_ids.device)
    places: List[Tuple[int, int, int]] = [(0, 0, 0)] * input_ids.shape[0]
    for b, rows in enumerate(bins):
        offset = 0
        for r in sorted(rows):  # original order inside a bin: the layout does not depend on the sort above
            n = int(lengths[r])
            ids[b, offset:offset + n] = input_ids[r, :n]
            positions[b, offset:offset + n] = torch.arange(n, device=input_ids.device)
            places[r] = (b, offset, n)
            offset += n
        positions[b, offset:] = torch.arange(width - offset, device=input_ids.device)
    return Packed(ids, positions, places, (int(input_ids.shape[0]), int(input_ids.shape[1])))


def unpack_token_logps(packed_logps: torch.Tensor, packed: Packed) -> torch.Tensor:
    """``[bins, width]`` log-probs of the packed layout (``out[b, c] = log p(token c | tokens before c)``) back to
    the padded ``[rows, T]`` layout of ``sequence_token_logps``: row ``r``'s position
    ``t`` (``1 <= t < length``) is its bin's ``offset + t``; position 0 and padding are 0. Differentiable (one
    gather, its index built on the host from ``packed.places`` and moved without waiting)."""
    rows, steps = packed.shape
    width = packed_logps.shape[1]
    flat_index = torch.zeros((rows, steps), dtype=torch.long)
    keep = torch.zeros((rows, steps), dtype=torch.bool)
    for r, (b, offset, n) in enumerate(packed.places):
        if n > 1:
            flat_index[r, 1:n] = b * width + offset + torch.arange(1, n)
            keep[r, 1:n] = True
    flat_index, keep = (t.to(packed_logps.device, non_blocking=True) for t in (flat_index, keep))
    values = packed_logps.reshape(-1).gather(0, flat_index.reshape(-1)).reshape(rows, steps)
    return torch.where(keep, values, torch.zeros_like(values))


def padding_fraction(attention_mask: torch.Tensor, packed: Packed) -> Tuple[float, float]:
    """Share of positions that are padding, before (``[rows, T]``) and after packing (``[bins, width]``)."""
    real = float(attention_mask.sum())
    return 1.0 - real / attention_mask.numel(), 1.0 - real / packed.input_ids.numel()


def packed_sequence_token_logps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                capacity: int, pad_token_id: int, chunk_tokens: int = 256,
                                temperature: float = 1.0, fused: bool = False, module=None,
                                device: Optional[torch.device] = None) -> torch.Tensor:
    """``sequence_token_logps`` through one packed forward: same ``[rows, T]`` result.
    ``chunk_tokens``: tokens per float32 block of the log-softmax (``train.logps_chunk_tokens``). ``fused``: from the
    hidden states (`hidden`; ``module`` is the causal LM inside ``model``), only for tokens that have a next
    token in their own sequence. ``input_ids`` and ``attention_mask`` may be the host-side batch: the bins (and the
    fused path's labels and their valid positions) are built where they are, then moved to ``device`` (default:
    where they are) without waiting."""
    packed = pack_rows(input_ids, attention_mask, capacity, pad_token_id)
    device = device if device is not None else input_ids.device
    ids, positions = (t.to(device, non_blocking=True) for t in (packed.input_ids, packed.position_ids))
    if fused:
        has_next = torch.zeros_like(packed.input_ids, dtype=torch.bool)
        for b, offset, n in packed.places:
            has_next[b, offset:offset + n - 1] = True
        labels = next_token_labels(packed.input_ids, has_next)
        labels, index = (t.to(device, non_blocking=True) for t in (labels, valid_positions(labels)))
        with logps_from_hidden(module if module is not None else model, labels, temperature, chunk_tokens, index):
            next_logps = model(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False)
        return unpack_token_logps(to_prefix_layout(next_logps), packed)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False).logits
    chunk_size = chunk_positions(ids.shape[0], chunk_tokens)
    return unpack_token_logps(prefix_token_logps(logits, ids, chunk_size, temperature), packed)
