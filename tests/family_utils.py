"""Tiny random checkpoints of the native model families, written by transformers itself (shared by
tests/engine/test_families.py and tests/serve/test_tensor_parallel.py; not a test module)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from rayspec.sampling.sampler import SamplingParams

VOCAB, HIDDEN, LAYERS = 256, 64, 3
WINDOW = 8  # the sliding windows: far shorter than prompt + output (~44 tokens)
GREEDY = SamplingParams(temperature=0, max_tokens=32)
# repetitive prompts (n-gram hits), 9-14 tokens: prompt + output crosses the window many times over
PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5],
    [40, 41, 42, 40, 41, 42, 40, 41, 42],
    [100, 3, 77, 200, 9, 31, 100, 3, 77, 200, 9],
    [11, 12, 13, 14, 15, 11, 12, 13, 14, 15, 11, 12, 13, 14],
]

_SHAPE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.2,  # at 0.02 the embedding dominates: most outputs repeat one token
              bos_token_id=None, eos_token_id=None, pad_token_id=None)  # no EOS: every output is 32 tokens

# name -> the transformers config of a tiny checkpoint of that family
FAMILIES = {
    "llama": lambda: LlamaConfig(**_SHAPE, attention_bias=True, mlp_bias=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=32)),
    "mistral": lambda: MistralConfig(**_SHAPE, sliding_window=WINDOW),  # every layer slides
    "qwen2": lambda: Qwen2Config(**_SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                 rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0,
                                                      original_max_position_embeddings=128)),
    "qwen3-tied": lambda: Qwen3Config(**_SHAPE, head_dim=32, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**_SHAPE, head_dim=32, attention_bias=True, use_sliding_window=True,
                                 sliding_window=WINDOW + 4,
                                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
}
SLIDING = ["mistral", "qwen2", "qwen3"]


def write_family(name: str, path) -> torch.nn.Module:
    """A random checkpoint of family `name` at `path` (safetensors); returns transformers' model."""
    torch.manual_seed(sum(map(ord, name)))
    hf = AutoModelForCausalLM.from_config(FAMILIES[name]()).float().eval()
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if pname.endswith("bias"):  # initialized to zero: a bias left out would go unnoticed
                p.normal_(0.0, 0.5)
            elif "norm" in pname:  # initialized to one: the same for the norms (q_norm / k_norm)
                p.normal_(1.0, 0.3)
    hf.save_pretrained(path, safe_serialization=True)
    return hf
