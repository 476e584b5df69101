"""`train.fused_logprobs`: per-token log-probs from the hidden states and the output weight (hl_core/logprobs/hidden.py)
against the plain path (the full logits, then log_softmax) in float64 and float32: values and the gradients of the
hidden states, the weight and the bias; with temperature, Gemma 2's soft-cap, invalid labels, any block size; through
Llama (tied and untied embeddings), Gemma 2 and a PEFT LoRA wrapper, padded and packed; the model's forward restored
after the call. The blocks' peak memory against a plain log_softmax is in bench/realistic_shapes.py."""

import pytest
import torch
import torch.nn.functional as F

from hl_core.logprobs import sequence_token_logps
from hl_core.logprobs.hidden import fused_sequence_token_logps, hidden_token_logps, logps_from_hidden
from hl_core.logprobs.packed import packed_sequence_token_logps


def plain(hidden, weight, labels, bias=None, temperature=1.0, softcap=None):
    z = F.linear(hidden, weight, bias)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    logps = (z / temperature).log_softmax(-1)
    valid = (labels >= 0) & (labels < weight.shape[0])
    return logps.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0] * valid


def _leaves(dtype, gen, rows=3, steps=11, width=8, vocab=37, bias=True):
    hidden = (torch.randn(rows, steps, width, generator=gen, dtype=torch.float64) * 2).to(dtype).requires_grad_(True)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(dtype).requires_grad_(True) if bias else None
    labels = torch.randint(0, vocab, (rows, steps), generator=gen)
    labels[0, :4] = -1  # e.g. padding
    labels[2, -1] = vocab  # out of range: 0, no gradient
    return hidden, weight, b, labels


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.0, 3.0), (0.7, 3.0)])
@pytest.mark.parametrize("block", [1, 4, 1000])
def test_values_and_gradients_equal_the_plain_path_float64(temperature, softcap, block):
    gen = torch.Generator().manual_seed(0)
    leaves = _leaves(torch.float64, gen)
    hidden, weight, bias, labels = leaves
    upstream = torch.randn(labels.shape, generator=gen, dtype=torch.float64)
    grads = {}
    for name, fn in (("plain", plain), ("ours", hidden_token_logps)):
        kwargs = dict(block_tokens=block) if name == "ours" else {}
        out = fn(hidden, weight, labels, bias=bias, temperature=temperature, softcap=softcap, **kwargs)
        grads[name] = (out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), [hidden, weight, bias]))
    ours, ref = grads["ours"], grads["plain"]
    assert ours[0].dtype == torch.float32 and ours[0].shape == labels.shape
    assert torch.equal(ours[0][labels < 0], torch.zeros_like(ours[0][labels < 0])) and (ours[0][1] != 0).all()
    assert torch.allclose(ours[0].double(), ref[0], atol=1e-5, rtol=0)  # the forward's output is float32
    for got, want in zip(ours[1:], ref[1:]):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-6)  # float64 gradients: the same function
    assert torch.equal(ours[1][0, :4], torch.zeros_like(ours[1][0, :4]))  # invalid labels: no gradient
    if softcap is not None:  # the cap does bite at these magnitudes: without it the values differ
        assert not torch.allclose(ours[0].double(), plain(hidden, weight, labels, bias, temperature).detach(),
                                  atol=1e-3)


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, 3.0)])
def test_the_block_size_changes_nothing_float64(temperature, softcap):
    """One token per block, blocks of 4 and one block for all: the same values and gradients."""
    gen = torch.Generator().manual_seed(3)
    hidden, weight, bias, labels = _leaves(torch.float64, gen)
    upstream = torch.randn(labels.shape, generator=gen, dtype=torch.float64)
    results = []
    for block in (1, 4, 10_000):
        out = hidden_token_logps(hidden, weight, labels, bias=bias, temperature=temperature, softcap=softcap,
                                 block_tokens=block)
        results.append((out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), [hidden, weight, bias])))
    for other in results[1:]:
        assert torch.allclose(results[0][0].double(), other[0].double(), atol=1e-6, rtol=0)  # float32 outputs
        for one, got in zip(results[0][1:], other[1:]):
            assert torch.allclose(one, got, atol=1e-12, rtol=1e-12)


def test_a_block_is_a_small_share_of_the_logits_and_few_blocks_cover_them():
    """`block_rows`: a block of logits holds at most 1/BLOCK_SHARE of ``[N, V]`` (or the floor of
    MIN_BLOCK_LOGITS) and never more than ``block_tokens`` rows; a large input takes about BLOCK_SHARE blocks."""
    from hl_core.logprobs.hidden import BLOCK_SHARE, MIN_BLOCK_LOGITS, block_rows

    for count, vocab in ((1024, 128_256), (8192, 128_256), (8192, 151_936), (1024, 256_000), (64, 32_000)):
        rows = block_rows(count, vocab, block_tokens=10**9)
        assert rows * vocab <= max(count * vocab // BLOCK_SHARE, MIN_BLOCK_LOGITS)
        if count * vocab // BLOCK_SHARE >= MIN_BLOCK_LOGITS:  # large: about BLOCK_SHARE blocks, not hundreds
            assert -(-count // rows) <= BLOCK_SHARE + 1, (count, vocab, rows)
    assert block_rows(8192, 128_256, block_tokens=256) == 128  # 1/64 of 8,192 tokens
    assert block_rows(1 << 20, 128_256, block_tokens=256) == 256  # the cap binds
    assert block_rows(1024, 128_256, block_tokens=256) == MIN_BLOCK_LOGITS // 128_256  # the floor: 32 rows, 16 MiB
    assert block_rows(3, 10**9, block_tokens=256) == 1


def test_a_no_grad_forward_keeps_nothing_and_gives_the_training_forward_values(monkeypatch):
    """The reference's forward (no grad, on the policy's trainable weight): no autograd node, Liger never called
    (its forward allocates an input-gradient buffer even without gradients), the same values as with grad."""
    import hl_core.logprobs.hidden as hidden_module

    gen = torch.Generator().manual_seed(4)
    hidden, weight, bias, labels = _leaves(torch.float32, gen)
    with_grad = hidden_token_logps(hidden, weight, labels, bias=bias, block_tokens=4)

    def no_liger():
        raise AssertionError("a no-grad forward must not reach Liger")

    monkeypatch.setattr(hidden_module, "_liger_function", no_liger)
    with torch.no_grad():
        without = hidden_token_logps(hidden, weight, labels, bias=bias, block_tokens=4, backend="liger")
    assert with_grad.grad_fn is not None and without.grad_fn is None and not without.requires_grad
    assert torch.equal(with_grad.detach(), without)


def test_float32_and_frozen_weight_without_bias():
    gen = torch.Generator().manual_seed(1)
    hidden, weight, _, labels = _leaves(torch.float32, gen, bias=False)
    weight.requires_grad_(False)  # e.g. LoRA's frozen base: no weight gradient is computed
    out = hidden_token_logps(hidden, weight, labels, temperature=0.8, block_tokens=5)
    ref = plain(hidden, weight, labels, temperature=0.8)
    assert torch.allclose(out, ref, atol=1e-5)
    g_ours, = torch.autograd.grad(out.sum(), [hidden])
    g_ref, = torch.autograd.grad(ref.sum(), [hidden])
    assert torch.allclose(g_ours, g_ref, atol=1e-5)
    with torch.no_grad():  # the reference's forward: no graph at all
        assert not hidden_token_logps(hidden, weight, labels).requires_grad


def test_bf16_weight_close_to_the_plain_path():
    gen = torch.Generator().manual_seed(2)
    hidden, weight, _, labels = _leaves(torch.bfloat16, gen, bias=False)
    out = hidden_token_logps(hidden, weight, labels, block_tokens=7)
    ref = plain(hidden.float(), weight.float(), labels)
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=0.1)
    out.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16


def _llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=53, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied,
                                        attn_implementation="eager"))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=53, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, final_logit_softcapping=0.5, attn_implementation="eager")
    return Gemma2ForCausalLM(config)


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for module in wrapped.modules():  # a non-zero adapter, so it matters to the result
        if hasattr(module, "lora_B"):
            for b in module.lora_B.values():
                torch.nn.init.normal_(b.weight, std=0.5)
    return wrapped


def _batch():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 53, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("build", ["llama_untied", "llama_tied", "gemma2_softcap", "llama_lora"])
@pytest.mark.parametrize("packed", [False, True])
def test_through_models_equal_the_logits_path_with_parameter_gradients(build, packed):
    model = {"llama_untied": lambda: _llama(False), "llama_tied": lambda: _llama(True), "gemma2_softcap": _gemma2,
             "llama_lora": lambda: _lora(_llama(False))}[build]()
    ids, mask = _batch()
    temperature = 0.7
    if packed:
        def run(fused):
            return packed_sequence_token_logps(model, ids, mask, capacity=9, pad_token_id=0, chunk_tokens=4,
                                               temperature=temperature, fused=fused)
    else:
        def run(fused):
            if fused:
                return fused_sequence_token_logps(model, ids, mask, block_tokens=4, temperature=temperature)
            return sequence_token_logps(model, ids, mask, chunk_size=3, temperature=temperature)
    params = [p for p in model.parameters() if p.requires_grad]
    results = {}
    for fused in (False, True):
        out = run(fused) * mask  # the objectives read real tokens only
        results[fused] = (out.detach(), torch.autograd.grad(out.sum(), params))
    assert torch.allclose(results[True][0], results[False][0], atol=1e-5)
    assert (results[True][0][0, 1:] != 0).all()
    for got, want in zip(results[True][1], results[False][1]):
        assert torch.allclose(got, want, atol=1e-5)
    # the model is itself again: forward gives logits
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    assert "forward" not in lm.__dict__ and "forward" not in lm.get_output_embeddings().__dict__
    assert model(input_ids=ids).logits.shape == (3, 9, 53)


def test_the_forward_is_restored_after_an_error():
    model = _llama(False)
    with pytest.raises(RuntimeError, match="boom"):
        with logps_from_hidden(model, torch.zeros(1, 2, dtype=torch.long)):
            raise RuntimeError("boom")
    assert "forward" not in model.__dict__ and "forward" not in model.lm_head.__dict__


def _liger_stand_in(_input, weight, target, ce_weight=None, bias=None, ignore_index=-100, lse_square_scale=0.0,
                    label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                    use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
                    ce_mode=None, token_grad_output=None, compute_gradients=None, weight_requires_grad=None,
                    chunk_mem_const=1):
    """Liger-Kernel 0.8.5's `fused_linear_cross_entropy_forward` contract (its keywords; returns loss, z_loss,
    accuracy, predicted tokens, grad_input, grad_weight, grad_bias; with `reduction="none"` the per-token
    cross-entropy, and with `token_grad_output` the gradients of `sum(token_grad_output * loss)`), computed in
    float64 from the full logits. Liger itself needs a GPU: this checks our side of the call on the CPU."""
    assert reduction == "none" and ignore_index == -100 and (target >= 0).all()
    with torch.enable_grad():  # called inside an autograd function's forward and backward
        leaves = [t.detach().double().requires_grad_(True) for t in (_input, weight)]
        b = bias.detach().double().requires_grad_(True) if bias is not None else None
        z = F.linear(leaves[0], leaves[1], b)
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        loss = -z.log_softmax(-1).gather(-1, target[:, None])[:, 0]
        weighted = (loss * token_grad_output.double()).sum() if compute_gradients else None
    grads = (None, None, None)
    if compute_gradients:
        wanted = [leaves[0]] + ([leaves[1]] if weight_requires_grad else []) + ([b] if b is not None else [])
        got = list(torch.autograd.grad(weighted, wanted))
        grads = (got.pop(0).to(_input.dtype), got.pop(0).to(weight.dtype) if weight_requires_grad else None,
                 got.pop(0).to(bias.dtype) if b is not None else None)
    return (loss.detach().float(), None, None, None, *grads)


@pytest.mark.parametrize("temperature,softcap", [(1.0, None), (0.7, None), (1.0, 3.0), (0.7, 3.0)])
def test_the_liger_path_gives_the_same_values_and_gradients(monkeypatch, temperature, softcap):
    """Our wrapper around Liger's function (sign of the loss and of the upstream gradient, the temperature folded
    into the hidden states, the PyTorch blocks where Liger has no temperature: with a soft-cap) against the plain
    path; the stand-in has Liger's keywords, so a changed call would fail here."""
    import hl_core.logprobs.hidden as hidden_module

    monkeypatch.setattr(hidden_module, "_LIGER_FN", [_liger_stand_in])
    calls = []
    monkeypatch.setattr(hidden_module._LigerLogps, "apply", staticmethod(
        lambda *a, _apply=hidden_module._LigerLogps.apply: calls.append(1) or _apply(*a)))
    gen = torch.Generator().manual_seed(4)
    hidden, weight, bias, labels = _leaves(torch.float64, gen)
    upstream = torch.randn(labels.shape, generator=gen, dtype=torch.float64)
    results = {}
    for backend in ("torch", "liger"):
        out = hidden_token_logps(hidden, weight, labels, bias=bias, temperature=temperature, softcap=softcap,
                                 backend=backend)
        results[backend] = (out.detach(), *torch.autograd.grad((out.double() * upstream).sum(), [hidden, weight, bias]))
    assert len(calls) == (1 if softcap is None or temperature == 1.0 else 0)
    for got, want in zip(results["liger"], results["torch"]):
        assert torch.allclose(got.double(), want.double(), atol=1e-5)


def test_an_adapter_on_the_output_layer_is_refused_naming_the_key():
    from hl_core.errors import RecipeError

    model = _llama(False)
    model.lm_head = torch.nn.Sequential(model.lm_head)  # not a plain linear layer
    with pytest.raises(RecipeError, match="`train.fused_logprobs: true`.*`Sequential`"):
        fused_sequence_token_logps(model, *_batch())


def test_the_fused_logps_bench_runs_here_and_agrees_with_the_plain_path(capsys):
    """bench/fused_logps.py at a small shape on the CPU (its GPU shape is the default): each row printed, the
    blockwise values and hidden-state gradients within float32 rounding of the plain path's."""
    from bench.fused_logps import main

    assert main(["--tokens", "96", "--width", "16", "--vocab", "1000", "--dtype", "fp32", "--repeats", "1",
                 "--block-tokens", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "8 rows per block, 12 blocks" in lines[0]
    rows = {(line[:10].strip(), line[11:41].strip()): line.split() for line in lines[2:]}
    assert set(rows) == {(impl, call) for impl in ("plain", "blockwise")
                         for call in ("reference (no-grad forward)", "policy (forward + backward)")}
    for (impl, call), cells in rows.items():
        assert float(cells[-2]) < 1e-5 and (cells[-1] == "-" or float(cells[-1]) < 1e-5), (impl, call, cells)
