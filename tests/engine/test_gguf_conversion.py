"""A GGUF checkpoint converted to safetensors (rayspec.model.weights.hub.convert_gguf), on a tiny Llama GGUF
written here with gguf's own writer (Q4_1 matrices, float32 norms, a byte-level BPE vocabulary): the file is
parsed once, not once per transformers loader, and what is written is byte for byte what transformers'
three separate parses write."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from rayspec.model.weights import hub

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 32, 2, 4, 2, 64


def write_tiny_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    tokens = (["<s>", "</s>"] + letters + ["Ġ", "ab", "t", "0", "t0"])
    tokens += [f"x{i}" for i in range(VOCAB - len(tokens))]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))  # 3: control
    w.add_token_merges(["a b", "t 0"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if len(shape) == 2:  # matrices in Q4_1, as the default model's are
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q4_1),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, a)

    head_dim = HIDDEN // HEADS
    tensor("token_embd.weight", VOCAB, HIDDEN)
    tensor("output_norm.weight", HIDDEN)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.ffn_norm.weight", HIDDEN)
        tensor(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        tensor(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        tensor(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


def test_parsed_once_and_written_as_three_parses_write_it(tiny_gguf, tmp_path, monkeypatch):
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    parses = []

    def counting_reader(*args, **kwargs):
        parses.append(args[0])
        return reader(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    fast = hub.convert_gguf(tiny_gguf, tmp_path / "fast")
    assert len(parses) == 1, parses
    assert gguf.GGUFReader is counting_reader and gguf.get_tensor_name_map is name_map  # restored after

    parses.clear()  # transformers alone: a parse per loader (config, tokenizer, weights)
    monkeypatch.setattr(hub, "_gguf_read_once", contextlib.nullcontext)
    slow = hub.convert_gguf(tiny_gguf, tmp_path / "slow")
    assert len(parses) == 3, parses
    names = sorted(p.name for p in fast.iterdir())
    assert names == sorted(p.name for p in slow.iterdir()) and "model.safetensors" in names, names
    for name in names:
        assert (fast / name).read_bytes() == (slow / name).read_bytes(), name


def test_restored_when_the_conversion_fails(tmp_path):
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(Exception):
        hub.convert_gguf(bad, tmp_path / "out")
    assert gguf.GGUFReader is reader and gguf.get_tensor_name_map is name_map
    assert not (tmp_path / "out").exists()


def test_converted_weights_and_tokenizer(tiny_gguf, tmp_path):
    """The embedding is gguf's own dequantization of the file's (no permutation applies to it), the
    config has the file's shapes, and the tokenizer applies the file's merges."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig, AutoTokenizer

    out = hub.convert_gguf(tiny_gguf, tmp_path / "out")
    config = AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size) == (HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB)
    weights = load_file(out / "model.safetensors")
    embd = next(t for t in gguf.GGUFReader(tiny_gguf).tensors if t.name == "token_embd.weight")
    want = gguf.quants.dequantize(embd.data, embd.tensor_type).reshape(VOCAB, HIDDEN)
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], want)
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == (HIDDEN, FFN)
    tokenizer = AutoTokenizer.from_pretrained(out)
    ab, a, b = tokenizer.convert_tokens_to_ids(["ab", "a", "b"])
    assert tokenizer("abba", add_special_tokens=False)["input_ids"] == [ab, b, a]
