import torch

from hl_core.logprobs import masked_mean, sequence_token_logps, token_logps


def test_chunked_token_logps_equals_full_log_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 37, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (3, 37), generator=gen)
    expected = logits.float().log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    for chunk in (1, 5, 16, 128):
        got = token_logps(logits, labels, chunk_size=chunk)
        assert torch.allclose(got, expected, atol=1e-5)


def test_bf16_logits_upcast_per_chunk_and_temperature():
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 9, 30, generator=gen) * 3).to(torch.bfloat16)
    labels = torch.randint(0, 30, (2, 9), generator=gen)
    expected = (logits.float() / 0.7).log_softmax(-1).gather(-1, labels[..., None])[..., 0]
    got = token_logps(logits, labels, chunk_size=4, temperature=0.7)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, atol=1e-5)


def test_invalid_labels_give_zero():
    logits = torch.randn(1, 3, 10)
    labels = torch.tensor([[1, -100, 10]])
    got = token_logps(logits, labels)
    assert got[0, 1] == 0 and got[0, 2] == 0 and got[0, 0] != 0


def test_sequence_token_logps_aligns_with_inputs():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    ids = torch.randint(0, 40, (2, 6))
    out = sequence_token_logps(model, ids, torch.ones_like(ids))
    logits = model(input_ids=ids).logits
    manual = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    assert out.shape == ids.shape and torch.all(out[:, 0] == 0)
    assert torch.allclose(out[:, 1:], manual, atol=1e-5)


def test_masked_mean():
    v = torch.tensor([[1.0, 2.0, 3.0]])
    m = torch.tensor([[1, 0, 1]])
    assert masked_mean(v, m).item() == 2.0
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0


def test_gradients_match_full_log_softmax_with_checkpointed_chunks():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(2, 23, 40, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 40, (2, 23), generator=gen)
    weights = torch.randn(2, 23, generator=gen, dtype=torch.float64)
    a = base.clone().requires_grad_(True)
    (token_logps(a, labels, chunk_size=5, temperature=0.7).double() * weights).sum().backward()
    b = base.clone().requires_grad_(True)
    ((b / 0.7).log_softmax(-1).gather(-1, labels[..., None])[..., 0] * weights).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_chunking_keeps_peak_memory_down():
    """Autograd saves only the (input) logits, not a float32 copy per chunk: compare saved-tensor bytes."""
    logits = torch.randn(1, 64, 512, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 512, (1, 64))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logps(logits, labels, chunk_size=8).sum()
    input_bytes = 64 * 512 * 2  # the bf16 logits themselves (views of them are what gets saved)
    label_bytes = 64 * 8
    assert sum(saved) <= input_bytes + label_bytes + 1024, (sum(saved), input_bytes)
    naive = []

    def pack_naive(t):
        naive.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack_naive, lambda t: t):
        logits.float().log_softmax(-1).gather(-1, labels[..., None]).sum()
    assert sum(saved) < 0.6 * sum(naive), (sum(saved), sum(naive))


def test_gradient_of_bf16_logits_with_invalid_labels_matches_float64():
    """The hand-written backward: bf16 logits get a bf16 gradient equal (to bf16 rounding) to the float64
    gradient of the plain log-softmax; padding labels get no gradient at all."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(2, 11, 70, generator=gen) * 3
    labels = torch.randint(0, 70, (2, 11), generator=gen)
    labels[0, 4] = -100
    labels[1, 10] = 70  # out of range: padding too
    weights = torch.randn(2, 11, generator=gen)
    a = base.to(torch.bfloat16).requires_grad_(True)
    (token_logps(a, labels, chunk_size=3, temperature=1.3) * weights).sum().backward()
    b = base.to(torch.bfloat16).double().requires_grad_(True)
    valid = (labels >= 0) & (labels < 70)
    ref = (b / 1.3).log_softmax(-1).gather(-1, labels.clamp(0, 69)[..., None])[..., 0] * valid
    (ref * weights.double()).sum().backward()
    assert a.grad.dtype == torch.bfloat16
    assert torch.allclose(a.grad.double(), b.grad, atol=2e-2 * b.grad.abs().max().item())
    assert torch.all(a.grad[0, 4] == 0) and torch.all(a.grad[1, 10] == 0)
    assert a.grad[0, 3].abs().sum() > 0
