"""rayspec.model.weights.plain_config: a plain Llama config.json read without transformers' config
classes gives what transformers' LlamaConfig gives for every field rayspec reads, with each optional
field present or left out; a config that is not plain Llama is left to transformers. (The loads that
use it, and what they no longer import: tests/engine/test_loader.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from rayspec.model.families import ModelArgs
from rayspec.model.loader import rope_from_config
from rayspec.model.weights.plain_config import (DEFAULTS, PlainConfig, llama_config, plain_llama_config,
                                                read_plain_config, tokenizer_kwargs)

SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json as the GGUF conversion writes it (transformers 5)
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 9.999999747378752e-06, "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "attention_bias": False, "mlp_bias": False, "head_dim": 64, "model_type": "llama", "dtype": "float32"}
OLD_STYLE = {  # a transformers 4 export: rope_theta at the top, torch_dtype, no head_dim
    "model_type": "llama", "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": None, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
HEAD = {  # the shipped EAGLE-3 head's (heads/smollm2-135m-eagle3): no rope fields at all
    "hidden_size": 576, "intermediate_size": 1024, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "rms_norm_eps": 9.999999747378752e-06, "max_position_embeddings": 8192, "vocab_size": 49152, "hidden_act": "silu",
    "model_type": "llama", "num_hidden_layers": 1, "tie_word_embeddings": False, "torch_dtype": "float16",
    "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 4096,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}}
# what rayspec reads of a config (ModelArgs.from_hf_config, the families, rope_from_config, the loaders)
READ = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rope_parameters", *DEFAULTS)
MISSING = object()


def _without(fields: dict, *keys) -> dict:
    return {k: v for k, v in fields.items() if k not in keys}


def _variants():
    yield "smollm2", SMOLLM2
    yield "old-style", OLD_STYLE
    yield "head", HEAD
    for key in (*DEFAULTS, "num_key_value_heads", "head_dim", "rope_parameters"):
        yield f"smollm2-no-{key}", _without(SMOLLM2, key)
    yield "no-rope-at-all", _without(OLD_STYLE, "rope_theta", "rope_scaling")
    yield "kv-heads-none", {**OLD_STYLE, "num_key_value_heads": None, "head_dim": None}
    yield "rope-parameters-without-type", {**_without(SMOLLM2, "rope_parameters"), "rope_parameters": {"rope_theta": 5e5}}


@pytest.mark.parametrize("name,fields", list(_variants()), ids=[n for n, _ in _variants()])
def test_reads_what_llama_config_reads(name, fields):
    from transformers import LlamaConfig

    plain, hf = plain_llama_config(fields), LlamaConfig(**fields)
    assert isinstance(plain, PlainConfig), name
    for key in READ:
        assert getattr(plain, key, MISSING) == getattr(hf, key, MISSING), (name, key)
    assert ModelArgs.from_hf_config(plain) == ModelArgs.from_hf_config(hf)
    (inv_plain, scale_plain), (inv_hf, scale_hf) = rope_from_config(plain), rope_from_config(hf)
    assert torch.equal(inv_plain, inv_hf) and scale_plain == scale_hf
    for key, value in fields.items():  # every other field kept as given (rope_theta moves into rope_parameters)
        if key not in READ and key != "rope_theta":
            assert getattr(plain, key) == value, key


@pytest.mark.parametrize("fields", [
    {**SMOLLM2, "model_type": "qwen2"},
    {**OLD_STYLE, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {**SMOLLM2, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
    {**SMOLLM2, "quantization_config": {"quant_method": "modelopt"}},
    {**SMOLLM2, "auto_map": {"AutoConfig": "x.Config"}},
    _without(SMOLLM2, "vocab_size"),
    {**SMOLLM2, "hidden_size": 576.0},
    {**SMOLLM2, "rms_norm_eps": None},
], ids=["qwen2", "llama3-rope", "yarn", "quantized", "custom-code", "no-vocab", "float-size", "null-eps"])
def test_anything_else_is_left_to_transformers(fields):
    from transformers import PreTrainedConfig

    assert plain_llama_config(fields) is None
    # (transformers itself refuses a float size and a null eps)
    if fields.get("model_type") == "llama" and not isinstance(fields.get("hidden_size"), float) \
            and fields.get("rms_norm_eps", 1.0) is not None:
        assert isinstance(llama_config(fields), PreTrainedConfig)


def test_read_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    config = read_plain_config(tmp_path)
    assert config.hidden_size == 576 and config._name_or_path == str(tmp_path)  # as AutoConfig sets it
    assert tokenizer_kwargs(tmp_path, config) == {}  # no tokenizer_config.json naming a class
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert tokenizer_kwargs(tmp_path, config) == {"config": config}
    assert tokenizer_kwargs(tmp_path, object()) == {}  # a transformers config: AutoTokenizer reads its own
    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2, "model_type": "mistral"}))
    assert read_plain_config(tmp_path) is None
    (tmp_path / "config.json").write_text("{not json")
    assert read_plain_config(tmp_path) is None
    assert read_plain_config(tmp_path / "absent") is None
