"""The batched sampler: per-prompt seeds independent of the batch, EOS/stop handling, nucleus and greedy."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hl_core.rollout.generation import _nucleus, sample_groups

EOS, PAD = 2, 0


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
                      pad_token_id=PAD, attn_implementation="eager")
    return LlamaForCausalLM(cfg).eval()


def _sample(model, groups, **kw):
    kw.setdefault("max_new_tokens", 6)
    return sample_groups(model, groups, eos_token_id=EOS, pad_token_id=PAD, **kw)


def test_a_prompts_samples_do_not_depend_on_the_rest_of_the_batch(model):
    a, b, c = [1, 5, 6], [1, 7, 8, 9, 3], [1, 4]
    together = _sample(model, [(a, 4, 11), (b, 3, 12), (c, 2, 13)])
    alone = [_sample(model, [g])[0] for g in [(a, 4, 11), (b, 3, 12), (c, 2, 13)]]
    assert together == alone
    reordered = _sample(model, [(c, 2, 13), (a, 4, 11)])
    assert reordered == [alone[2], alone[0]]
    assert _sample(model, [(a, 4, 99)])[0] != alone[0], "another seed draws other samples"
    assert [len(group) for group in together] == [4, 3, 2]


def test_left_padded_batch_matches_unpadded_logits(model):
    """Greedy decoding of a short prompt is the same alone and next to a longer one (padding + positions)."""
    short, long = [1, 4, 5], [1, 9, 8, 7, 6, 3]
    alone = _sample(model, [(short, 1, 0)], greedy=True)[0]
    mixed = _sample(model, [(long, 1, 0), (short, 1, 0)], greedy=True)[1]
    assert mixed == alone
    # and greedy is the argmax chain computed without a cache
    ids = list(short)
    for _ in range(len(alone[0])):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] == EOS:
            break
    assert alone[0] == ids[len(short):]


def test_completions_end_at_eos_and_keep_it(model):
    def eos_likely(**kw):  # +1.5 on the EOS logit: about one token in three ends a completion
        out = model(**kw)
        out.logits[..., EOS] += 1.5
        return out

    out = _sample(eos_likely, [([1, 3], 32, 5)], max_new_tokens=8)[0]
    ended = [c for c in out if EOS in c]
    assert ended and len(ended) < len(out), "some rows end early, some run to the cap"
    for c in ended:
        assert c.index(EOS) == len(c) - 1, "nothing after the first EOS"
    assert all(len(c) == 8 for c in out if EOS not in c)
    assert len({len(c) for c in ended}) > 1


class _CharTok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids if i not in (EOS, PAD))


def test_stop_string_ends_a_row_and_lockstep_runs_every_forward(model):
    calls = []

    def counted(**kw):
        calls.append(kw["input_ids"].shape)
        return model(**kw)

    free = _sample(model, [([1, 3], 16, 7)], max_new_tokens=10)[0]
    letter = next(_CharTok().decode([t]) for c in free for t in c if t not in (EOS, PAD))
    stopped = _sample(counted, [([1, 3], 16, 7)], max_new_tokens=10, stop=[letter], tokenizer=_CharTok())[0]
    for full, cut in zip(free, stopped):
        text = _CharTok().decode(cut)
        assert full[: len(cut)] == cut, "same draws up to the stop"
        if letter in _CharTok().decode(full):
            assert text.endswith(letter) and letter not in text[:-1]
    assert any(len(c) < len(f) for c, f in zip(stopped, free))
    early = len(calls)
    calls.clear()
    _sample(counted, [([1, 3], 16, 7)], max_new_tokens=10, stop=[letter], tokenizer=_CharTok(), lockstep=True)
    assert len(calls) == 10 and early <= 10
    calls.clear()
    assert _sample(counted, [], max_new_tokens=3, lockstep=True) == []
    assert len(calls) == 3, "a rank without prompts still takes part in every forward"


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert torch.allclose(_nucleus(probs, 0.7), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    assert torch.allclose(_nucleus(probs, 0.5), torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(_nucleus(probs, 1.0), probs)


def test_temperature_sharpens_the_sampling_distribution(model):
    prompt = [1, 6, 7]
    cold = _sample(model, [(prompt, 64, 3)], temperature=1e-4, max_new_tokens=1)[0]
    greedy = _sample(model, [(prompt, 1, 3)], greedy=True, max_new_tokens=1)[0][0]
    hot = _sample(model, [(prompt, 64, 3)], temperature=5.0, max_new_tokens=1)[0]
    assert sum(c == greedy for c in cold) >= 60
    assert len({tuple(c) for c in hot}) > len({tuple(c) for c in cold})


@pytest.mark.parametrize("greedy,temperature,top_p", [(True, 1.0, 1.0), (False, 1.0, 1.0), (False, 0.7, 0.9)])
def test_static_cache_gives_the_same_samples_as_the_dynamic_cache(model, greedy, temperature, top_p):
    """`rollout.kv_cache: static` (a preallocated cache, fixed shapes; on a GPU its decode step replays as a CUDA
    graph, not exercised here) against today's growing cache: the same completions for the same seeds, greedy and
    sampled, with prompts of different lengths (left padding) and rows ending at EOS at different steps."""
    groups = [([1, 5, 6], 6, 11), ([1, 7, 8, 9, 3, 4, 5], 5, 12), ([1, 4], 4, 13)]
    kw = dict(max_new_tokens=12, greedy=greedy, temperature=temperature, top_p=top_p)
    dynamic = _sample(model, groups, **kw)
    pool = {}
    static = _sample(model, groups, kv_cache="static", pool=pool, **kw)
    assert static == dynamic
    kept = next(iter(pool.values()))
    assert _sample(model, groups, kv_cache="static", pool=pool, **kw) == dynamic  # the kept cache, reset: the same
    assert next(iter(pool.values())) is kept
    lengths = {len(c) for group in dynamic for c in group}
    assert len(lengths) > 1 or greedy  # sampled rows end at different steps: the mask of ended rows matters


def test_static_cache_step_distributions_equal_the_dynamic_ones(model):
    """The same distribution at every step, not only the same draws: the logits each path feeds the sampler agree
    to 1e-5 over a whole decode (recorded through the model call)."""
    seen = {"dynamic": [], "static": []}

    def recording(kind):
        def forward(**kw):
            out = model(**kw)
            seen[kind].append(out.logits[:, -1].float().clone())
            return out
        forward.config = model.config
        return forward

    groups = [([1, 5, 6], 3, 21), ([1, 7, 8, 9, 3], 3, 22)]
    for kind in seen:
        _sample(recording(kind), groups, max_new_tokens=8, kv_cache=kind)
    assert len(seen["static"]) == len(seen["dynamic"]) > 1
    for a, b in zip(seen["dynamic"], seen["static"]):
        assert torch.allclose(a, b, atol=1e-5)


def test_the_sampler_picks_the_static_cache_on_a_gpu_only():
    from types import SimpleNamespace

    from hl_core.rollout.generation import HFSampler, static_cache_length

    def sampler(choice):
        return HFSampler(None, None, SimpleNamespace(kv_cache=choice))

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert sampler("auto").kv_cache(cpu, False) == "dynamic"
    assert sampler("auto").kv_cache(gpu, False) == "static"
    assert sampler("auto").kv_cache(gpu, True) == "dynamic"  # ZeRO-3 lockstep: hooks gather parameters
    assert sampler("static").kv_cache(cpu, True) == "static"
    assert static_cache_length(1) == 64 and static_cache_length(64) == 64 and static_cache_length(65) == 128


def test_static_decode_compiles_whole_with_the_gradient_checkpointing_hook():
    """On a GPU the static path's decode step is compiled whole (``fullgraph``). Gradient checkpointing makes
    transformers hook the input embeddings to call ``requires_grad_`` on their output, which torch 2.11's dynamo
    cannot hold in a whole graph (an H100's online GRPO run stopped there; this machine's torch 2.13 traces it either
    way, so what is checked here is the switch): the hooks are off while the sampler decodes, the step compiled whole
    (dynamo, eager backend) gives the eager samples, and the hooks are back for training afterwards."""
    from hl_core.rollout.generation import without_input_grad_hooks

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS,
                      pad_token_id=PAD, attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    model.gradient_checkpointing_enable()
    embeddings = model.get_input_embeddings()
    assert embeddings._forward_hooks, "transformers hooks the embeddings under gradient checkpointing"
    groups = [([1, 5, 6], 2, 11), ([1, 7, 8, 9], 2, 12)]
    eager = _sample(model, groups, kv_cache="static", max_new_tokens=3)
    torch._dynamo.reset()
    step = torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=False)
    with without_input_grad_hooks(model):
        assert not embeddings._forward_hooks
        assert _sample(model, groups, kv_cache="static", step=step, max_new_tokens=3) == eager
    assert embeddings._forward_hooks, "the hooks are back for training"
    torch._dynamo.reset()
