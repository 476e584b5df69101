"""Hugging Face <-> megatron-core conversion (pure tensor code, no processes): bit-exact round trips for
Llama, Qwen2 (q/k/v biases, tied embeddings) and Gemma 2 at any tp x pp, agreement with mbridge where it
has a bridge, stage-local reads, and the Hugging Face directory writer."""

import pytest
import torch

pytest.importorskip("megatron.core")

from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config  # noqa: E402

from hl_core.engines.megatron_convert import (  # noqa: E402
    LazyHFCheckpoint,
    hf_state_dict,
    hf_to_mcore,
    mcore_to_hf,
    save_hf_directory,
)

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _configs():
    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False),
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True),
        "gemma2": Gemma2Config(**COMMON, tie_word_embeddings=True, sliding_window=4, query_pre_attn_scalar=24),
    }


def _hf(cfg):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p))  # distinct values, so a swapped norm or bias cannot round-trip
    return hf_state_dict(model)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_round_trip_is_bit_exact_for_every_layout(family):
    cfg = _configs()[family]
    sd = _hf(cfg)
    assert ("lm_head.weight" in sd) == (family == "llama")  # tied models carry no lm_head
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in sd
    if family == "gemma2":
        assert "model.layers.1.post_feedforward_layernorm.weight" in sd
    for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2)]:
        shards = hf_to_mcore(sd, cfg, tp, pp)
        assert set(shards) == {(p, t) for p in range(pp) for t in range(tp)}
        back = mcore_to_hf(shards, cfg, tp, pp)
        assert set(back) == set(sd), (tp, pp, set(back) ^ set(sd))
        for name, value in sd.items():
            assert torch.equal(back[name], value), (tp, pp, name)
        # the shards really are split: TP halves the column-/row-parallel tensors, PP splits the layers
        first = shards[(0, 0)]
        qkv_rows = (4 + 2 * 2) * 16  # heads + 2 x kv heads, times head_dim
        assert first["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (qkv_rows // tp, 64)
        assert first["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 64 // tp)
        assert first["embedding.word_embeddings.weight"].shape == (96 // tp, 64)
        layers = {k.split(".")[2] for k in first if k.startswith("decoder.layers.")}
        assert len(layers) == 2 // pp
        last = shards[(pp - 1, 0)]
        assert ("output_layer.weight" in last) == (family == "llama" or pp > 1)


def test_qkv_layout_interleaves_query_groups():
    """megatron-core's fused QKV: per group, its query heads then its key then its value head."""
    cfg = _configs()["llama"]
    sd = _hf(cfg)
    qkv = hf_to_mcore(sd, cfg)[(0, 0)]["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (sd[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    group = qkv.view(2, 4 * 16, 64)  # 2 groups of (2 query heads + k + v) x head_dim 16
    assert torch.equal(group[1, :32], q[32:]) and torch.equal(group[1, 32:48],
                                                              k[16:]) and torch.equal(group[1, 48:], v[16:])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_agrees_with_mbridge(family):
    """mbridge converts Llama and Qwen2 with the same layouts (Transformer Engine names): tensor for tensor."""
    pytest.importorskip("mbridge")
    from mbridge.core.parallel_states import ParallelStates
    from mbridge.models.llama import LLaMABridge
    from mbridge.models.qwen2 import Qwen2Bridge

    cfg = _configs()[family]
    cfg.tie_word_embeddings = False  # mbridge's tied Qwen2 path maps the output layer onto the embeddings
    sd = _hf(cfg)
    tp = 2
    bridge = {"llama": LLaMABridge, "qwen2": Qwen2Bridge}[family](
        cfg, dtype=torch.float32, parallel_states=ParallelStates(tp_size=tp)
    )
    mine = hf_to_mcore(sd, cfg, tp, 1, te=True)
    for name, shard0 in mine[(0, 0)].items():
        full = bridge._weight_to_mcore_format(name, [sd[n] for n in bridge._weight_name_mapping_mcore_to_hf(name)])
        theirs = bridge._weight_split_across_tp(name, full, shard0, tp)
        for t in range(tp):
            assert torch.equal(theirs[t], mine[(0, t)][name]), name
    assert len(mine[(0, 0)]) == (17 if family == "qwen2" else 15)


class _CountingMapping(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.read = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def test_one_rank_reads_only_its_stage():
    cfg = _configs()["llama"]
    source = _CountingMapping(_hf(cfg))
    shard = hf_to_mcore(source, cfg, 2, 2, ranks=[(1, 1)])
    assert list(shard) == [(1, 1)]
    assert not any(k.startswith("model.layers.0.") or k == "model.embed_tokens.weight" for k in source.read)
    assert "lm_head.weight" in source.read and "model.layers.1.mlp.up_proj.weight" in source.read


def test_hf_directory_writer_and_lazy_reader(tmp_path):
    from transformers import AutoTokenizer

    from helpers import REPO

    cfg = _configs()["gemma2"]
    sd = _hf(cfg)
    tokenizer = AutoTokenizer.from_pretrained(REPO / "tests/fixtures/tiny/model")
    save_hf_directory(sd, cfg, str(tmp_path / "one"), tokenizer)
    save_hf_directory(sd, cfg, str(tmp_path / "sharded"), max_shard_bytes=40_000)  # several files + index
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    for directory in ("one", "sharded"):
        lazy = LazyHFCheckpoint(str(tmp_path / directory))
        assert set(lazy) == set(sd) and all(torch.equal(lazy[k], sd[k]) for k in sd)
        loaded = hf_state_dict(AutoModelForCausalLM.from_pretrained(tmp_path / directory))
        assert set(loaded) == set(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert (tmp_path / "one" / "tokenizer.json").exists()
    # a rank's shard read slice by slice from the safetensors equals the in-memory conversion
    lazy = LazyHFCheckpoint(str(tmp_path / "sharded"))
    from_disk, in_memory = hf_to_mcore(lazy, cfg, 2, 2), hf_to_mcore(sd, cfg, 2, 2)
    for key, shard in in_memory.items():
        assert set(from_disk[key]) == set(shard) and all(torch.equal(from_disk[key][n], shard[n]) for n in shard)
