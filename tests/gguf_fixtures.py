"""Small synthetic GGUF files for the tests (written with the ``gguf`` package, seconds to convert): a two-layer Llama
with a byte-level BPE tokenizer (the 256 bytes, a few merges, three special tokens), float32 weights from a seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 16, 2, 2, 1, 32, 256
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "Ġ a", "h e", "i n", "r e"]
TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_tokens():
    """GPT-2's byte-to-unicode table: the 256 byte tokens of a byte-level BPE vocabulary."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    codes, extra = printable[:], 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for _, c in sorted(zip(printable, codes))]


def tokens():
    merged = [m.replace(" ", "") for m in MERGES]
    return _byte_tokens() + merged + SPECIAL


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    """A whole tiny Llama GGUF file at ``path`` (its weights drawn from ``seed``); returns ``path``."""
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab = tokens()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("hl tiny llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * (len(vocab) - len(SPECIAL)) + [3] * len(SPECIAL))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(vocab.index("<|im_start|>"))
    writer.add_eos_token_id(vocab.index("<|im_end|>"))
    writer.add_pad_token_id(vocab.index("<|endoftext|>"))
    writer.add_chat_template(TEMPLATE)

    def weight(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    head_dim = HIDDEN // HEADS
    writer.add_tensor("token_embd.weight", weight(len(vocab), HIDDEN))
    for layer in range(LAYERS):
        block = f"blk.{layer}"
        writer.add_tensor(f"{block}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"{block}.attn_q.weight", weight(HIDDEN, HIDDEN))
        writer.add_tensor(f"{block}.attn_k.weight", weight(KV_HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"{block}.attn_v.weight", weight(KV_HEADS * head_dim, HIDDEN))
        writer.add_tensor(f"{block}.attn_output.weight", weight(HIDDEN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"{block}.ffn_gate.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_up.weight", weight(FFN, HIDDEN))
        writer.add_tensor(f"{block}.ffn_down.weight", weight(HIDDEN, FFN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
