"""Numerics that must hold whatever dtype the model runs in: rotary tables stay float32 after a
cast, and equal transformers' up to the model's maximum position (default and llama3 rope scaling)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rayspec.eagle.checkpoint import new_eagle_config
from rayspec.eagle.head import build_head
from rayspec.loader import build_model, rope_from_config

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _config(scaling: dict | None) -> LlamaConfig:
    # Llama-3.1's rotary settings (head_dim 64 here, as SmolLM2's) on a one-layer model
    return LlamaConfig(hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=64, rope_theta=500000.0 if scaling else 100000.0,
                       max_position_embeddings=131072 if scaling else 8192, rope_scaling=scaling)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_rotary_tables_float32_and_equal_to_transformers(scaling, dtype):
    config = _config(scaling)
    model = build_model(config, None, "cpu", dtype)
    assert next(model.parameters()).dtype == dtype and model.inv_freq.dtype == torch.float32
    model = model.to(torch.float32).to(dtype)  # any later cast keeps them too
    assert model.inv_freq.dtype == torch.float32
    reference = LlamaRotaryEmbedding(config)
    positions = torch.cat([torch.arange(0, 2048), torch.arange(2048, config.max_position_embeddings, 97),
                           torch.tensor([config.max_position_embeddings - 1])])[None]
    cos, sin = model.rope(positions, torch.float32)  # the tables before the cast to the activations' dtype
    want_cos, want_sin = reference(torch.zeros(1, dtype=torch.float32), positions)
    assert (cos[:, 0] - want_cos).abs().max().item() <= 1e-6
    assert (sin[:, 0] - want_sin).abs().max().item() <= 1e-6
    # what the test guards against: frequencies rounded to the model's dtype are far off at long range
    rounded = positions.float()[..., None] * model.inv_freq.to(dtype).float()
    assert (torch.cat((rounded, rounded), -1).cos() * reference.attention_scaling - want_cos).abs().max() > 0.1
    # the activations' tables come out in their dtype
    assert model.rope(positions[:, :8], dtype)[0].dtype == dtype


def test_eagle_head_rotary_stays_float32(tmp_path):
    config = _config(LLAMA3_SCALING)
    config.save_pretrained(tmp_path)
    head_config = new_eagle_config("eagle3", tmp_path, 3, config.hidden_size)
    inv_freq, _ = rope_from_config(LlamaConfig(**head_config.hf_config))
    head = build_head(head_config).to(torch.bfloat16)
    assert next(head.parameters()).dtype == torch.bfloat16
    assert head.inv_freq.dtype == torch.float32 and torch.equal(head.inv_freq, inv_freq)
