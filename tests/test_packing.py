"""Padding-free forwards (hl_core/logprobs/packed.py): bin packing by hand, the packed layout, and on a real (tiny,
random init) Llama the packed log-probs and their gradients equal the padded ones, with attention isolated between the
sequences sharing a bin, under eager and sdpa attention."""

from __future__ import annotations

import pytest
import torch

from helpers import REPO
from hl_core.logprobs import sequence_token_logps
from hl_core.logprobs.packed import (
    first_fit_bins,
    pack_rows,
    packed_sequence_token_logps,
    padding_fraction,
    unpack_token_logps,
)

PAD = 0


def test_first_fit_bins_by_hand():
    # decreasing: 7 (row 1), 5 (row 0), 4 (row 3), 3 (row 2), 1 (row 4); capacity 8
    assert first_fit_bins([5, 7, 3, 4, 1], 8) == [[1, 4], [0, 2], [3]]  # 4 fits nowhere: a new bin; 3 fills bin 1
    assert first_fit_bins([2, 2, 2, 2], 4) == [[0, 1], [2, 3]]  # ties by row index
    assert first_fit_bins([3], 3) == [[0]]
    with pytest.raises(ValueError, match="more than the bin capacity"):
        first_fit_bins([3, 9], 8)


def _batch(lengths, width, seed=0, vocab=50):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for r, n in enumerate(lengths):
        ids[r, :n] = torch.randint(1, vocab, (n,), generator=gen)
        mask[r, :n] = 1
    return ids, mask


def test_pack_rows_layout_by_hand():
    ids, mask = _batch([3, 5, 2], 6)
    packed = pack_rows(ids, mask, capacity=6, pad_token_id=PAD)
    # bins: [row 1 (5)] then rows 0 (3) and 2 (2) share the second; inside a bin rows keep their order
    assert packed.places == [(1, 0, 3), (0, 0, 5), (1, 3, 2)]
    assert packed.input_ids.shape == (2, 5)
    assert packed.input_ids[1].tolist() == ids[0, :3].tolist() + ids[2, :2].tolist()
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed.real_tokens == 10
    before, after = padding_fraction(mask, packed)
    assert before == pytest.approx(1 - 10 / 18) and after == 0.0
    # the padded tail of a bin restarts its positions: a separate sequence
    tail = pack_rows(*_batch([3, 1], 4), capacity=6, pad_token_id=PAD)
    assert tail.position_ids.tolist() == [[0, 1, 2, 0]]


def test_unpack_places_values_and_zeroes_the_rest():
    ids, mask = _batch([3, 2], 4)
    packed = pack_rows(ids, mask, capacity=8, pad_token_id=PAD)
    values = torch.arange(1.0, 1.0 + packed.input_ids.numel()).reshape(packed.input_ids.shape)
    out = unpack_token_logps(values, packed)
    assert out.tolist() == [[0.0, 2.0, 3.0, 0.0], [0.0, 5.0, 0.0, 0.0]]


def _model(attn: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(REPO / "tests" / "fixtures" / "tiny" / "model"))
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).float().eval(), config.vocab_size


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_packed_equals_padded_with_gradients(attn):
    model, vocab = _model(attn)
    ids, mask = _batch([9, 4, 13, 2, 7, 6], 13, seed=1, vocab=vocab)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) * mask

    padded = sequence_token_logps(model, ids, mask, chunk_size=8)
    (padded * weights).sum().backward()
    padded_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    packed = packed_sequence_token_logps(model, ids, mask, capacity=16, pad_token_id=PAD, chunk_tokens=16)
    (packed * weights).sum().backward()

    real = mask.bool() & (torch.arange(ids.shape[1]) > 0)
    assert torch.allclose(packed[real], padded[real], atol=1e-5, rtol=0)
    assert (packed[~real] == 0).all()
    for got, want in zip((p.grad for p in model.parameters()), padded_grads):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_is_isolated_between_packed_sequences(attn):
    """Rows 0 and 2 share a bin; changing row 0's tokens leaves rows 1 and 2 bit-for-bit unchanged."""
    model, vocab = _model(attn)
    ids, mask = _batch([5, 9, 4], 9, seed=3, vocab=vocab)
    with torch.no_grad():
        first = packed_sequence_token_logps(model, ids, mask, capacity=10, pad_token_id=PAD)
        changed = ids.clone()
        changed[0, :5] = (changed[0, :5] % (vocab - 2)) + 1
        assert not torch.equal(changed, ids)
        second = packed_sequence_token_logps(model, changed, mask, capacity=10, pad_token_id=PAD)
    assert pack_rows(ids, mask, 10, PAD).places[0][0] == pack_rows(ids, mask, 10, PAD).places[2][0]
    assert torch.equal(first[1:], second[1:])
    assert not torch.equal(first[0], second[0])
